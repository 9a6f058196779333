"""The P:D controller inside the router (``--controller``; docs/controller.md).

    RouterController   built from the router's settings and its InstancePool; ``start`` after
                       the pool's first poll (the plan in force is the flex engines' roles
                       then) builds the ``Controller`` and starts its loop (the one loop:
                       a tick every --controller-interval), with ``_after_tick`` as its hook
      PoolStatsSource  the monitor's samples: the Stats the router's own poll fetched (no
                       second poll of the engines)
      PoolActuator     in place: (Drain →) SetRole on the pool's flex engines, over the
                       router's channels (its admin credential); colocated plans too unless
                       --controller-colocated=false
      Policy           --controller-prefer: split (the default: a split while it keeps up
                       with the load x (1 + --controller-headroom)) or goodput
      RedisLease       when the router has Redis: one acting controller among the routers
    The router reports each admitted request (``arrived``: prompt and answer lengths, for the
    predictor) and each finished one (``finished``: TTFT, TPOT, inter-token gaps, for the
    LatencySink); each tick logs the latency summary next to the decision line.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from pdserve.controller.actuator import ROLES, Actuator, DryRunActuator, InPlaceActuator
from pdserve.controller.capacity import (
    MAX_BATCH,
    CalibrationError,
    CapacityModel,
    from_measured,
    starting_model,
)
from pdserve.controller.lease import RedisLease
from pdserve.controller.loop import Controller, LoopConfig
from pdserve.controller.monitor import (
    LatencySink,
    ResourceMonitor,
    Sample,
    StatsSource,
    sample_from_proto,
)
from pdserve.controller.optimizer import Cluster, Decision, Plan, Policy, Slo
from pdserve.controller.predictor import Arrival, WorkloadWindow
from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc
from services.router.config import RouterConfig
from services.router.instances import Instance, InstancePool

log = logging.getLogger(__name__)


def _polled(pool: InstancePool) -> list[Instance]:
    """Instances whose Stats the last poll fetched (healthy, or out only while draining)."""
    return [i for i in pool.instances.values()
            if i.stats.instance_id and (i.is_healthy or i.stats.draining)]


class PoolStatsSource(StatsSource):
    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    async def sample(self) -> list[Sample]:
        now = time.monotonic()
        return [sample_from_proto(i.stats, i.address, now) for i in _polled(self.pool)]


class PoolActuator(InPlaceActuator):
    """``InPlaceActuator`` over the pool's engines as they are now (the registry may add some)."""

    def __init__(self, pool: InstancePool, rpc_timeout_s: float = 5.0,
                 drain_timeout_s: float = 300.0) -> None:
        self.pool = pool
        self.rpc_timeout_s, self.drain_timeout_s = rpc_timeout_s, drain_timeout_s
        self._channels: dict[str, Any] = {}  # the pool owns the channels

    def stubs(self) -> dict[str, engine_pb2_grpc.EngineStub]:
        return {a: i.engine for a, i in self.pool.instances.items()}

    def confirmed(self, address: str, stats: engine_pb2.EngineStats) -> None:
        """The pool learns the new role now, not at its next poll: calls for the old role
        would be refused (FAILED_PRECONDITION) and take the engine out of rotation."""
        inst = self.pool.instances.get(address)
        if inst is not None:
            inst.apply_stats(stats)


def current_plan(samples: Sequence[Sample], flex_only: bool) -> Plan:
    """The plan the engines run now (the flex ones only, when they are what may move). A mix
    of colocated and prefill/decode engines (a switch that failed half way) is kept as it is:
    no plan the optimizer offers equals it, so the controller moves to one."""
    engines = [s for s in samples if s.is_flex or not flex_only]
    return Plan(*(sum(s.role == r for s in engines) for r in ROLES))


def make_actuator(config: RouterConfig, pool: InstancePool) -> Actuator:
    if config.controller == "in-place":
        return PoolActuator(pool)
    if config.controller == "kubernetes":
        from pdserve.controller.k8s import Deployments, KubernetesActuator, api_client

        return KubernetesActuator(api_client(), Deployments(config.controller_namespace))
    return DryRunActuator()


@functools.cache
def calibrated_model(path: str = "") -> CapacityModel:
    """The model to start from until the engines' Stats determine one: the bench run at
    ``path`` (--controller-calibration), else the shipped 2-core one."""
    return starting_model(path)


class RouterController:
    """The controller of one router; ``arrived``/``finished`` are called per request."""

    def __init__(self, config: RouterConfig, pool: InstancePool,
                 model: CapacityModel | None = None) -> None:
        self.config, self.pool = config, pool
        self.slo = Slo(config.slo_ttft_ms / 1000, config.slo_tpot_ms / 1000)
        self.model = model or calibrated_model(config.controller_calibration)
        self.window = WorkloadWindow(config.controller_window)
        self.latency = LatencySink(config.controller_window, self.slo.ttft_s, self.slo.tpot_s)
        self.lease: RedisLease | None = None
        if pool.redis is not None:
            holder = f"{socket.gethostname()}:{config.port}:{os.getpid()}"
            self.lease = RedisLease(pool.redis, f"{config.registry_prefix}controller:leader",
                                    holder, config.controller_lease_ms)
        self.controller: Controller | None = None

    def arrived(self, prompt_tokens: int, max_tokens: int) -> None:
        self.window.add(Arrival(time.monotonic(), prompt_tokens, max_tokens))

    def finished(self, ttft_s: float, tpot_s: float, itls_s: Sequence[float]) -> None:
        self.latency.observe(time.monotonic(), ttft_s, tpot_s, itls_s)

    def build(self) -> Controller:
        """The loop, its plan in force read from the pool (call after its first poll); it
        starts from the engines' own measurements when every polled engine has them and no
        --controller-calibration was given."""
        in_place = self.config.controller == "in-place"
        polled = _polled(self.pool)
        if not self.config.controller_calibration:
            self.model = engines_model(polled) or self.model
        samples = [sample_from_proto(i.stats, i.address, 0.0) for i in polled]
        plan = current_plan(samples, in_place)
        n = plan.num_prefill + plan.num_decode + plan.num_colocated
        if n == 0:
            log.warning("controller: no engine to plan for yet (flex engines for in-place)")
        cluster = Cluster(max(1, n), allow_colocated=self.config.controller_colocated)
        loop_config = LoopConfig(self.config.controller_interval,
                                 self.config.controller_interval, self.slo,
                                 self.config.controller_chunk)
        policy = Policy(plan, self.config.controller_margin, self.config.controller_dwell,
                        now=time.monotonic(), stable_s=self.config.controller_stabilize,
                        prefer=self.config.controller_prefer,
                        headroom=self.config.controller_headroom)
        monitor = ResourceMonitor(PoolStatsSource(self.pool), self.config.controller_window)
        return Controller(monitor, self.window, self.model, policy, cluster,
                          make_actuator(self.config, self.pool), loop_config, self.lease,
                          on_tick=self._after_tick)

    def current_model(self) -> CapacityModel:
        """The model in use: the loop's latest refit, or the one it starts from."""
        return self.controller.model if self.controller is not None else self.model

    async def start(self) -> None:
        self.controller = self.build()
        log.info("controller started", extra={"fields": {
            "mode": self.config.controller, "plan": str(self.controller.policy.plan),
            "leader_election": self.lease is not None}})
        self.controller.start()

    def _after_tick(self, decision: Decision | None) -> None:
        """The loop's hook: the latency the router measured, next to the decision line."""
        s = self.latency.summary(time.monotonic())
        log.info("controller latency", extra={"fields": {
            "requests": s.count, "ttft_p99_s": s.ttft_p99_s, "tpot_p50_s": s.tpot_p50_s,
            "itl_p99_s": s.itl_p99_s, "slo_attainment": s.slo_attainment}})

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop()


def engines_model(instances: Sequence[Instance]) -> CapacityModel | None:
    """The capacity model the engines' own start-up measurements give (``--calibrate``), or
    None unless every one of them has them (and they fit)."""
    stats = [i.stats for i in instances]
    if not stats or any(s.measured_prefill_tokens_per_s <= 0 for s in stats):
        return None
    try:
        model = from_measured([s.measured_prefill_tokens_per_s for s in stats],
                              [(p.batch, p.seconds) for s in stats
                               for p in s.measured_decode_steps], MAX_BATCH)
    except CalibrationError as exc:
        log.warning("controller: the engines' measurements do not fit; starting from the "
                    "calibration file", extra={"fields": {"error": str(exc)}})
        return None
    log.info("controller: starting from the engines' own measurements", extra={"fields": {
        "engines": len(stats), "prefill_tokens_per_s": round(model.prefill_tokens_per_s, 1),
        "decode_step_ms": {int(b): round(1e3 * t, 2) for b, t in model.decode_points}}})
    return model


def maybe_controller(config: RouterConfig, pool: InstancePool) -> RouterController | None:
    return None if config.controller == "off" else RouterController(config, pool)
