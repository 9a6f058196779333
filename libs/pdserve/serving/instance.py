"""One engine instance as a service sees it: the engine thread, the kvd bridge, its role, the
admission limits, drain state and its registry entry.

    create_instance(config) -> Instance     (loads the model, starts nothing)
    await instance.start(port)              engine thread, kvd registration, registry heartbeat
    with instance.admit(kind): ...          one request in flight (UNAVAILABLE / EXHAUSTED)
    await instance.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import torch

from pdserve.engine.engine import Engine
from pdserve.serving.async_engine import AsyncEngine
from pdserve.serving.config import EngineServiceConfig
from pdserve.serving.convert import Limits

log = logging.getLogger(__name__)


class Rejected(Exception):
    """A request this instance will not take now; carries the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Instance:
    def __init__(self, config: EngineServiceConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.aengine = AsyncEngine(engine, config.stats_window)
        self.is_flex = config.role == "flex"
        # A flex instance starts in the role its service is named after.
        self.role = config.role if not self.is_flex else self._flex_start_role()
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.bridge: Any = None  # KvBridge when --kvd is set (imported lazily: ucxx)
        self.address = ""
        self._heartbeat: asyncio.Task[None] | None = None
        self._redis: Any = None
        max_prompt = engine.max_model_len - 1
        if config.max_prompt_tokens:
            max_prompt = min(max_prompt, config.max_prompt_tokens)
        self.limits = Limits(max_prompt, engine.config.vocab_size, config.default_max_tokens)

    def _flex_start_role(self) -> str:
        return "decode" if type(self.config).__name__.startswith("Decode") else "prefill"

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
            from pdserve.kvd.client import KvdClient
            from pdserve.serving.kv_bridge import KvBridge

            client = KvdClient(self.config.kvd, f"engine-{self.instance_id}",
                               secret=self.config.kvd_secret)
            self.bridge = KvBridge(self.aengine, client, self.config.kvd)
            await self.bridge.register()
        if self.config.redis_url:
            await self._start_heartbeat()

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._redis is not None:
            await self._redis.aclose()
        if self.bridge is not None:
            await self.bridge.client.close()
        await self.aengine.close()

    async def _start_heartbeat(self) -> None:
        import redis.asyncio as aioredis

        from pdserve.registry import InstanceRecord, heartbeat_task

        if self._redis is None:
            self._redis = aioredis.Redis.from_url(self.config.redis_url)
        record = InstanceRecord(
            instance_id=self.instance_id, role="flex" if self.is_flex else self.role,
            address=self.address,
            kvd_node_id=self.bridge.node_id if self.bridge is not None else "",
            kvd_address=self.config.kvd, model=self.config.model, block_size=self.block_size)
        self._heartbeat = asyncio.create_task(heartbeat_task(
            self._redis, record, ttl=self.config.registry_ttl,
            prefix=self.config.registry_prefix))

    # -- admission ------------------------------------------------------------------------

    @contextlib.contextmanager
    def admit(self, *roles: str) -> Iterator[None]:
        """Count one request in flight, or raise Rejected (wrong role, draining, full)."""
        if self.role not in roles:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                           f"this instance runs role {self.role}; it serves this call only in "
                           f"role {' or '.join(roles)}")
        if self.draining:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "instance is draining: try another")
        limit = self.config.max_num_seqs + self.config.max_queued
        if self.num_in_flight >= limit:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{self.num_in_flight} requests in flight (the limit is "
                           f"--max-num-seqs + --max-queued = {limit}): try another instance")
        self.num_in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                self._idle.set()

    async def drain(self, wait: bool) -> int:
        self.draining = True
        if wait:
            await self._idle.wait()
        return self.num_in_flight

    async def set_role(self, role: str) -> None:
        """Flex only: drain, switch, accept work again, re-announce in the registry."""
        if not self.is_flex:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                           f"role: only a flex instance (--role flex) may switch; this one runs "
                           f"{self.role}")
        if role not in ("prefill", "decode"):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"role: a flex instance switches between prefill and decode, "
                           f"got {role}")
        if role == self.role:
            return
        await self.drain(wait=True)
        self.role = role
        self.draining = False
        log.info("role switched", extra={"fields": {"role": role}})


def create_instance(config: EngineServiceConfig) -> Instance:
    """Load the model and build the engine (slow: done once, before the server starts)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    return Instance(config, Engine.from_model(config.model, config.engine_args()))
