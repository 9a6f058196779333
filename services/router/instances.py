"""Engine instances as the router sees them: discovery, health, load, and cached stubs.

Instances come from static flags (``--prefill``/``--decode``; role and kvd learned from
``Engine.Stats``) and from the Redis registry (``pdserve.registry``), keyed by address so an
engine listed both ways is one instance. ``poll_once`` refreshes the registry, then checks every
instance's gRPC health and stats concurrently. An instance leaves the rotation when a check
fails, it drains, it disappears from the registry, or a request sees it UNAVAILABLE; it returns
at the first poll that finds it healthy. If Redis is down the last known instances are kept.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import RedisError

from pdserve.channel import KEEPALIVE_OPTIONS, insecure_channel
from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from pdserve.registry import InstanceRecord, list_instances
from pdserve.roles import Role

log = logging.getLogger(__name__)

# An engine that restarts must be back in the rotation within moments of its start: gRPC's
# default reconnect backoff grows to two minutes (attempts on loopback or a LAN cost little).
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100),
                     ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 250))
# How long requests in flight on an instance that left the registry may still finish.
EXPIRED_GRACE_S = 60.0


@dataclass
class Instance:
    """One engine: what it reported at the last poll, plus this router's own live counters."""

    address: str
    role: int  # common_pb2.Role; ROLE_UNSPECIFIED until known
    instance_id: str = ""
    kvd_node_id: str = ""
    kvd_address: str = ""
    model: str = ""
    is_static: bool = False
    credentials: tuple[tuple[str, str], ...] = ()  # presented on every call (pdserve.auth)
    is_healthy: bool = False
    stats: engine_pb2.EngineStats = field(default_factory=engine_pb2.EngineStats)
    # This router's view, fresher than the polled stats between polls.
    num_inflight_prefills: int = 0
    num_inflight_prefill_tokens: int = 0
    num_inflight_decodes: int = 0
    num_routed: int = 0
    num_errors: int = 0
    num_check_timeouts: int = 0  # consecutive Stats calls that timed out
    is_checking: bool = False  # a health check is in flight
    # Engines report recent throughput, which is load as much as speed (an idle engine shows
    # ~0): the fastest rate an instance has shown is the better estimate of what it can do.
    peak_prefill_tokens_per_s: float = 0.0
    channel: grpc.aio.Channel | None = None
    prefill: Any = None  # engine_pb2_grpc.PrefillStub
    decode: Any = None  # engine_pb2_grpc.DecodeStub
    engine: Any = None  # engine_pb2_grpc.EngineStub
    health: Any = None  # health_pb2_grpc.HealthStub

    def __post_init__(self) -> None:
        if not self.instance_id:
            self.instance_id = self.address
        # One channel per instance for its whole life: no per-request connection setup.
        # Keepalive: calls on an instance whose node is partitioned or lost fail (and are
        # retried elsewhere) in seconds, instead of hanging until their deadline.
        self.channel = insecure_channel(self.address, *RECONNECT_OPTIONS, *KEEPALIVE_OPTIONS,
                                        credentials=self.credentials)
        self.prefill = engine_pb2_grpc.PrefillStub(self.channel)
        self.decode = engine_pb2_grpc.DecodeStub(self.channel)
        self.engine = engine_pb2_grpc.EngineStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def prefill_load(self) -> int:
        return max(self.stats.queue_depth, self.num_inflight_prefills)

    @property
    def decode_load(self) -> int:
        return max(self.stats.num_running, self.num_inflight_decodes)

    def update(self, record: InstanceRecord) -> None:
        self.role = Role(record.role).proto or self.role
        self.instance_id = record.instance_id
        self.kvd_node_id, self.kvd_address = record.kvd_node_id, record.kvd_address
        self.model = record.model

    def apply_stats(self, stats: engine_pb2.EngineStats) -> None:
        self.stats = stats
        self.peak_prefill_tokens_per_s = max(self.peak_prefill_tokens_per_s,
                                             stats.prefill_tokens_per_s)
        self.role = stats.role or self.role  # a flex engine may have switched
        self.instance_id = stats.instance_id or self.instance_id
        self.model = stats.model or self.model
        if stats.kvd.node_id:
            self.kvd_node_id, self.kvd_address = stats.kvd.node_id, stats.kvd.address

    async def close(self, grace: float | None = None) -> None:
        """Close the channel; with ``grace``, calls in flight get that long to finish."""
        if self.channel is not None:
            await self.channel.close(grace)


class InstancePool:
    """Every known instance, kept current by ``poll_once`` (run periodically by the router)."""

    def __init__(self, static_prefill: Iterable[str], static_decode: Iterable[str],
                 redis: Any = None, registry_prefix: str = "pdserve:",
                 check_timeout: float = 1.0,
                 credentials: tuple[tuple[str, str], ...] = (),
                 max_check_failures: int = 1) -> None:
        self.redis = redis
        self.credentials = credentials
        self.registry_prefix = registry_prefix
        self.check_timeout = check_timeout
        self.max_check_failures = max_check_failures
        self.instances: dict[str, Instance] = {}
        self._closing: set[asyncio.Task[None]] = set()
        # Set (and replaced) whenever an instance comes back: requests waiting for one wake.
        self.came_back = asyncio.Event()
        self.is_registry_available = redis is not None
        for role, addresses in ((common_pb2.ROLE_PREFILL, static_prefill),
                                (common_pb2.ROLE_DECODE, static_decode)):
            for address in addresses:
                self.instances[address] = Instance(address, role, is_static=True,
                                                   credentials=credentials)

    def healthy(self, role: int) -> list[Instance]:
        return [i for i in self.instances.values() if i.is_healthy and i.role == role]

    def mark_failed(self, instance: Instance, code: grpc.StatusCode | None) -> None:
        """A request saw ``instance`` fail. Down (UNAVAILABLE) or in another role than known
        (FAILED_PRECONDITION) takes it out until a poll finds it up and learns its role."""
        instance.num_errors += 1
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, None):
            if instance.is_healthy:
                log.warning("instance left the rotation", extra={"fields": {
                    "instance": instance.instance_id, "code": str(code)}})
            instance.is_healthy = False

    async def poll_once(self) -> None:
        if self.redis is not None:
            await self._refresh_registry()
        await asyncio.gather(*(self._check(i) for i in list(self.instances.values())))

    async def recheck_loop(self, interval: float) -> None:
        """Every ``interval``, check the instances out of the rotation (each in its own task,
        one at a time per instance): a restarted engine is back as soon as it answers, not at
        the next poll; a paused one's slow check holds up no other."""
        checks: set[asyncio.Task[None]] = set()
        try:
            while True:
                await asyncio.sleep(interval)
                for inst in list(self.instances.values()):
                    if not inst.is_healthy and not inst.is_checking:
                        task = asyncio.create_task(self._check(inst))
                        checks.add(task)
                        task.add_done_callback(checks.discard)
        finally:
            for task in checks:
                task.cancel()

    async def close(self) -> None:
        for task in self._closing:
            task.cancel()
        await asyncio.gather(*(i.close() for i in self.instances.values()), *self._closing,
                             return_exceptions=True)

    async def _refresh_registry(self) -> None:
        try:
            records = await list_instances(self.redis, self.registry_prefix)
        except (RedisError, OSError) as exc:
            if self.is_registry_available:
                log.warning("registry unreachable; keeping the last known instances",
                            extra={"fields": {"error": str(exc)}})
            self.is_registry_available = False
            return
        if not self.is_registry_available:
            log.info("registry reachable again")
        self.is_registry_available = True
        live = {r.address: r for r in records}
        for address, record in live.items():
            if address not in self.instances:
                log.info("instance registered", extra={"fields": {
                    "instance": record.instance_id, "role": record.role, "address": address}})
                self.instances[address] = Instance(address, Role(record.role).proto,
                                                   credentials=self.credentials)
            self.instances[address].update(record)
        for address, inst in list(self.instances.items()):
            if not inst.is_static and address not in live:
                log.info("instance expired from the registry",
                         extra={"fields": {"instance": inst.instance_id}})
                del self.instances[address]
                # Its requests in flight may finish: a lost heartbeat is not a dead engine.
                task = asyncio.create_task(inst.close(grace=EXPIRED_GRACE_S))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    async def _check(self, inst: Instance) -> None:
        if inst.is_checking:  # the recheck loop's: one at a time
            return
        inst.is_checking = True
        try:
            await self._check_now(inst)
        finally:
            inst.is_checking = False

    async def _check_now(self, inst: Instance) -> None:
        # wait_for_ready: a poll waits out a reconnect instead of failing during backoff.
        results: tuple[Any, Any] = await asyncio.gather(
            inst.health.Check(health_pb2.HealthCheckRequest(), timeout=self.check_timeout,
                              wait_for_ready=True),
            inst.engine.Stats(engine_pb2.EngineStatsRequest(), timeout=self.check_timeout,
                              wait_for_ready=True), return_exceptions=True)
        health, stats = results
        if isinstance(health, grpc.RpcError):
            # Health is answered off the engine thread: a process that cannot answer it in
            # time is down, paused or hung, never just busy. Out at once.
            inst.num_check_timeouts = 0
            self._set_health(inst, False, f"health check: {health.code().name}")
            return
        if isinstance(stats, grpc.RpcError):
            # Stats that timed out on a live process is a busy engine as often as a broken
            # one: only several in a row count; one that refuses or drops connections is out
            # at once. (wait_for_ready turns a refused connection into a timeout too: the
            # channel's state tells them apart.)
            assert inst.channel is not None
            is_busy = (stats.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                       and inst.channel.get_state() == grpc.ChannelConnectivity.READY)
            inst.num_check_timeouts = inst.num_check_timeouts + 1 if is_busy else 0
            if not is_busy or inst.num_check_timeouts >= self.max_check_failures:
                self._set_health(inst, False, f"stats: {stats.code().name}")
            return
        for result in (health, stats):
            if isinstance(result, BaseException):
                raise result
        assert isinstance(health, health_pb2.HealthCheckResponse)
        assert isinstance(stats, engine_pb2.EngineStats)
        inst.num_check_timeouts = 0
        inst.apply_stats(stats)
        serving = health.status == health_pb2.HealthCheckResponse.SERVING
        ok = serving and not stats.draining and inst.role != common_pb2.ROLE_UNSPECIFIED
        self._set_health(inst, ok, "" if ok else ("draining" if stats.draining else "not serving"))

    def _set_health(self, inst: Instance, ok: bool, why: str) -> None:
        if ok != inst.is_healthy:
            log.info("instance healthy" if ok else "instance unhealthy",
                     extra={"fields": {"instance": inst.instance_id, "why": why}})
            if ok:
                self.came_back.set()
                self.came_back = asyncio.Event()
        inst.is_healthy = ok
