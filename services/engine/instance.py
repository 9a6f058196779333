"""One engine instance as a service sees it: the engine thread, the kvd bridge, its role, the
admission limits, drain state and its registry entry.

    create_instance(config) -> EngineInstance   (loads the model, starts nothing)
    await instance.start(port)              engine thread, kvd registration, registry heartbeat
    with instance.admit(kind): ...          one request in flight (UNAVAILABLE / EXHAUSTED)
    await instance.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import grpc
import torch

from pdserve import auth
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.calibrate import Measured, measure
from pdserve.engine.engine import Engine
from pdserve.engine.reload import ReloadPolicy, SwapResult, prepare_weights, swap_weights
from pdserve.errors import BadRequest, StatusError
from pdserve.kvd.bridge import KvBridge
from pdserve.kvd.client import KvdClient
from pdserve.kvd.link import KvdLink
from pdserve.roles import Role
from services.engine.config import EngineServiceConfig
from services.engine.convert import EngineLimits

log = logging.getLogger(__name__)

# The roles a flex instance switches between, and what a request it hands back is told.
SWITCHABLE = (Role.PREFILL, Role.DECODE, Role.COLOCATED)
HANDED_BACK = "instance is switching role: try another"
HAND_BACK_POLL_S = 0.05


class ReloadReport(NamedTuple):
    swap: SwapResult
    load_ms: float
    wait_ms: float


class EngineInstance:
    def __init__(self, config: EngineServiceConfig, engine: Engine,
                 measured: Measured | None = None) -> None:
        self.config = config
        self.engine = engine
        self.aengine = AsyncEngine(engine, config.stats_window)
        self.is_flex = config.is_flex
        self.role = config.initial_role
        self.draining = False
        self.num_in_flight = 0
        self.measured = measured  # --calibrate: what create_instance measured
        self._idle = asyncio.Event()
        self._idle.set()
        self._restartable: set[str] = set()  # engine request ids a role switch may hand back
        self.model_source = config.model  # what the served weights were loaded from
        self._reloading = False
        self.bridge: KvBridge | None = None  # when --kvd is set
        self.kvd_link: KvdLink | None = None
        self.address = ""
        self._heartbeat: asyncio.Task[None] | None = None
        self._redis: Any = None
        max_prompt = engine.max_model_len - 1
        if config.max_prompt_tokens:
            max_prompt = min(max_prompt, config.max_prompt_tokens)
        self.limits = EngineLimits(max_prompt, engine.config.vocab_size,
                                   config.default_max_tokens)

    @property
    def instance_id(self) -> str:
        return self.config.instance_id or self.address

    @property
    def block_size(self) -> int:
        return self.engine.kv.block_size

    # -- life cycle -----------------------------------------------------------------------

    async def start(self, port: int) -> None:
        self.address = self.config.advertise or f"{self.config.host}:{port}"
        self.aengine.start()
        if self.config.kvd:
            client = KvdClient(self.config.kvd, f"engine-{self.instance_id}",
                               secret=auth.secrets().get(auth.DATA.name, ""))
            self.bridge = KvBridge(self.aengine, client, self.config.kvd)
            self.kvd_link = KvdLink(self.bridge)
            await self.kvd_link.start()  # registered now, and again whenever the kvd restarts
        if self.config.redis_url:
            await self._start_heartbeat()

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._redis is not None:
            await self._redis.aclose()
        if self.kvd_link is not None:
            await self.kvd_link.stop()
        if self.bridge is not None:
            await self.bridge.drain()  # readers' Releases sent in the background
            if self.bridge.staging is not None:
                self.bridge.staging.close()  # unregister the pool before it is unmapped
            await self.bridge.client.close()
        await self.aengine.close()

    async def _start_heartbeat(self) -> None:
        import redis.asyncio as aioredis

        from pdserve.registry import InstanceRecord, heartbeat_task

        if self._redis is None:
            self._redis = aioredis.Redis.from_url(self.config.redis_url)
        record = InstanceRecord(
            instance_id=self.instance_id, role=Role.FLEX if self.is_flex else self.role,
            address=self.address,
            kvd_node_id=self.bridge.node_id if self.bridge is not None else "",
            kvd_address=self.config.kvd, model=self.config.model, block_size=self.block_size)
        self._heartbeat = asyncio.create_task(heartbeat_task(
            self._redis, record, ttl=self.config.registry_ttl,
            prefix=self.config.registry_prefix))

    # -- admission ------------------------------------------------------------------------

    @contextlib.contextmanager
    def admit(self, *roles: Role, restartable: str = "") -> Iterator[None]:
        """Count one request in flight, or raise StatusError (wrong role, draining, full).

        ``restartable``: the engine request id of a request that may start on another
        instance as long as none of it has run here (a prompt to prefill, on a prefill or
        colocated instance; never a decode of KV made elsewhere): a role switch hands it back
        while it is still queued (``set_role``)."""
        if self.role not in roles:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"this instance runs role {self.role}; it serves this call only "
                              f"in role {' or '.join(roles)}")
        if self.draining:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "instance is draining: try another")
        limit = self.config.max_num_seqs + self.config.max_queued
        if self.num_in_flight >= limit:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.num_in_flight} requests in flight (the limit is "
                              f"--max-num-seqs + --max-queued = {limit}): try another instance")
        self.num_in_flight += 1
        self._idle.clear()
        if restartable:
            self._restartable.add(restartable)
        try:
            yield
        finally:
            self._restartable.discard(restartable)
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                self._idle.set()

    async def drain(self, wait: bool) -> int:
        self.draining = True
        if wait:
            await self._idle.wait()
        return self.num_in_flight

    @property
    def max_prefill_tokens(self) -> int:
        """The prompt tokens a step that also decodes may carry now."""
        cap = self.engine.scheduler.max_prefill_tokens
        return self.config.max_num_batched_tokens if cap is None else cap

    async def set_role(self, role: Role, max_prefill_tokens: int = 0) -> int:
        """Flex only: switch to ``role``, accept work again; returns how many queued requests
        were handed back. ``max_prefill_tokens``: the prompt tokens a step that also decodes
        may carry from now on (0: the engine's --max-num-batched-tokens), set between two
        steps, also when the role stays.

        To colocated, at once: a colocated engine serves both kinds of call, so whatever was
        admitted in the old role runs on. Otherwise drain; hand back the requests admitted
        but not started (UNAVAILABLE ``HANDED_BACK``, which the router retries elsewhere),
        sweeping again every ``HAND_BACK_POLL_S`` for those still on their way into the
        engine; wait for the running ones to finish (decodes are never dropped); switch."""
        if not self.is_flex:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"role: only a flex instance (--role flex) may switch; this one "
                              f"runs {self.role}")
        if role not in SWITCHABLE:
            raise BadRequest(f"role: a flex instance switches between prefill, decode and "
                             f"colocated, got {role}")
        if max_prefill_tokens > self.config.max_num_batched_tokens:
            raise BadRequest(f"max_prefill_tokens: at most this engine's --max-num-batched-tokens "
                             f"({self.config.max_num_batched_tokens}), got {max_prefill_tokens}")
        cap = max_prefill_tokens or None

        def set_cap(engine: Engine) -> None:
            engine.scheduler.max_prefill_tokens = cap

        if role == self.role:
            await self.aengine.call(set_cap)
            return 0
        num_handed_back = 0
        if role != Role.COLOCATED:
            self.draining = True
            while not self._idle.is_set():
                num_handed_back += len(await self.aengine.refuse_waiting(
                    set(self._restartable), StatusError(grpc.StatusCode.UNAVAILABLE,
                                                        HANDED_BACK)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), HAND_BACK_POLL_S)
        await self.aengine.call(set_cap)
        self.role = role
        self.draining = False
        log.info("role switched", extra={"fields": {"role": role, "handed_back": num_handed_back,
                                                    "max_prefill_tokens": max_prefill_tokens}})
        return num_handed_back

    async def load_weights(self, source: str, policy: ReloadPolicy,
                           resume: bool) -> ReloadReport:
        """Prepare ``source``'s weights off the step loop, then swap them in at a step
        boundary (``pdserve.engine.reload``). ``resume``: accept work again afterwards, also
        when the load failed (a drained instance goes back into rotation)."""
        if self._reloading:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              "LoadWeights: another LoadWeights is running on this instance")
        if policy is ReloadPolicy.REPREFILL and self.role == Role.PREFILL:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              "policy: RELOAD_POLICY_REPREFILL is for decode and colocated "
                              "instances; a prefill instance's in-flight blocks are already "
                              "promised under the old version (use RELOAD_POLICY_FINISH)")
        self._reloading, was_draining = True, self.draining
        try:
            return await self._load_weights(source, policy)
        finally:  # swapped or not (then the old weights serve on), as asked
            self._reloading = False
            self.draining = False if resume else was_draining

    async def _load_weights(self, source: str, policy: ReloadPolicy) -> ReloadReport:
        start = time.perf_counter()
        lm = await asyncio.to_thread(prepare_weights, source, self.engine)
        loaded = time.perf_counter()
        if policy is ReloadPolicy.FINISH:
            self.draining = True  # in-flight requests finish on the old weights
            await self._idle.wait()
            while await self.aengine.call(lambda e: e.has_unfinished()):
                await asyncio.sleep(0.005)  # streams the last RPCs left, still stepping
        waited = time.perf_counter()
        result = await self.aengine.call(lambda e: swap_weights(e, lm, policy))
        self.model_source = source
        log.info("weights reloaded", extra={"fields": {
            "model": source, "version": self.engine.model_version,
            "swap_ms": round(result.swap_s * 1e3, 2)}})
        return ReloadReport(result, (loaded - start) * 1e3, (waited - loaded) * 1e3)


def kvd_timeout(context: grpc.aio.ServicerContext, default: float) -> float:
    """How long a kvd wait may take: ``default``, or less when the rpc's deadline is sooner."""
    remaining = context.time_remaining()
    return default if remaining is None else max(0.001, min(default, remaining))


def create_instance(config: EngineServiceConfig) -> EngineInstance:
    """Load the model and build the engine (slow: done once, before the server starts)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    engine = Engine.from_model(config.model, config.engine_args())
    measured = None
    if config.calibrate:  # before the AsyncEngine owns the engine's steps
        measured = measure(engine)
        log.info("capacity measured", extra={"fields": {
            "prefill_tokens_per_s": round(measured.prefill_tokens_per_s, 1),
            "decode_step_ms": {b: round(1e3 * s, 2) for b, s in measured.decode_steps}}})
    return EngineInstance(config, engine, measured)
