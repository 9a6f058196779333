"""The control loop: monitor → predict → optimize → act, once per ``interval_s``.

Each tick polls the engines' Stats, refits the capacity model from them when they determine
it (else keeps the last model: the bench calibration it started from), forecasts the load
``horizon_s`` ahead from the router's admitted requests, lets the ``Policy`` decide, and — only
while this router holds the lease (or when there is no lease) — applies a changed plan. Every
tick logs ``controller decision: p=2 d=1 reason=...`` and updates the metrics below.

``start`` runs the one loop (the router's ``--controller`` too): sleep ``interval_s``, tick,
then call the ``on_tick`` hook (the router logs its latency summary there). A tick that raises
is logged and the loop goes on; so is a hook that raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.exceptions
from prometheus_client import Counter, Gauge

from pdserve.controller.actuator import ActuationError, Actuator
from pdserve.controller.capacity import CalibrationError, CapacityModel, from_stats
from pdserve.controller.lease import RedisLease
from pdserve.controller.monitor import ResourceMonitor
from pdserve.controller.optimizer import (
    ENGINE_CHUNK,
    Cluster,
    Decision,
    Policy,
    Slo,
    best_plan,
    colocated_chunk_tokens,
)
from pdserve.controller.predictor import Arrival, Load, WorkloadWindow

log = logging.getLogger(__name__)

PLAN_INSTANCES = Gauge("pdserve_controller_plan_instances", "Instances per role in the plan in "
                       "force (prefill, decode, colocated)", ["role"])
DECISIONS = Counter("pdserve_controller_decisions_total", "Controller ticks by outcome (switch, "
                    "hold, not_leader, failed)", ["outcome"])
PREDICTED_RATE = Gauge("pdserve_controller_predicted_rate", "Forecast arrival rate, requests/s")
PLAN_CAPACITY = Gauge("pdserve_controller_plan_capacity", "Requests/s the plan in force serves "
                      "within the SLOs at the forecast load (capacity model)")
IS_LEADER = Gauge("pdserve_controller_leader", "1 while this controller holds the lease")


def implausible(m: CapacityModel, load: Load, slo: Slo, cluster: Cluster) -> str:
    """Why a model fitted from Stats cannot be right, or "". The engines' rates average over
    their own Stats window, idle time included, so a partly idle engine looks slow; a fit under
    which no plan serves the forecast mix within the SLOs at all contradicts the requests being
    served, and would leave the controller nothing to choose."""
    if m.step_time(1) > slo.tpot_s:
        return f"a decode step of one sequence {m.step_time(1):.3f}s > TPOT SLO {slo.tpot_s}s"
    if load.rate > 0 and best_plan(m, load, slo, cluster).capacity <= 0:
        return (f"no plan serves {load.input_len:.0f}/{load.output_len:.0f} tokens within the "
                f"SLOs (prefill {m.prefill_tokens_per_s:.0f} tokens/s)")
    return ""


@dataclass(frozen=True)
class LoopConfig:
    interval_s: float = 10.0
    horizon_s: float = 10.0
    slo: Slo = Slo(2.0, 0.1)
    chunk_tokens: int = 0  # colocated steps' prompt tokens; 0: from the TPOT SLO each tick


class Controller:
    def __init__(self, monitor: ResourceMonitor, window: WorkloadWindow, model: CapacityModel,
                 policy: Policy, cluster: Cluster, actuator: Actuator, config: LoopConfig,
                 lease: RedisLease | None = None,
                 on_tick: Callable[[Decision | None], None] | None = None) -> None:
        self.monitor, self.window, self.model = monitor, window, model
        self.base_model = model  # the calibration it started from: the fallback
        self.policy, self.cluster, self.actuator = policy, cluster, actuator
        self.config, self.lease, self.on_tick = config, lease, on_tick
        self._task: asyncio.Task[None] | None = None
        self._publish_plan()

    def observe(self, arrival: Arrival) -> None:
        """The router reports each admitted request (prompt length, expected answer length;
        ``arrival.t`` on ``time.monotonic()``)."""
        self.window.add(arrival)

    def _refit(self, load: Load) -> None:
        """The first plausible model for this load: a fresh fit from the window's Stats, the
        model in use, the calibration it started from (one plausible for another mix may not
        be for this one); when none is, the model in use is kept."""
        slo, candidates = self.config.slo, []
        with contextlib.suppress(CalibrationError):
            candidates.append(("refit", from_stats(self.monitor.samples(),
                                                   self.model.max_batch)))
        candidates += [("in use", self.model), ("starting calibration", self.base_model)]
        rejected: list[str] = []
        for name, model in candidates:
            why = implausible(model, load, slo, self.cluster)
            if not why:
                if rejected:
                    log.info("controller: model rejected", extra={"fields": {
                        "rejected": "; ".join(rejected), "using": name}})
                self.model = model
                return
            rejected.append(f"{name}: {why}")
        log.info("controller: no plausible model, keeping the one in use",
                 extra={"fields": {"rejected": "; ".join(rejected)}})

    async def tick(self, now: float) -> Decision:
        await self.monitor.poll()
        load = self.window.forecast(now, self.config.horizon_s)
        self._refit(load)
        self._size_chunk()
        PREDICTED_RATE.set(load.rate)
        leading = self.lease is None or self.lease.is_leader
        IS_LEADER.set(1 if leading else 0)
        if not leading:
            DECISIONS.labels("not_leader").inc()
            return Decision(self.policy.plan, False, "not the leader", load, 0.0)
        before = self.policy.plan, self.policy.changed_at
        decision = self.policy.decide(now, self.model, load, self.config.slo, self.cluster)
        outcome = "switch" if decision.changed else "hold"
        if decision.changed:
            try:
                await self.actuator.apply(decision.plan)
            except ActuationError as exc:
                self.policy.plan, self.policy.changed_at = before  # not in force: retry later
                outcome = "failed"
                decision = Decision(before[0], False, f"failed: {exc}", load, 0.0)
        DECISIONS.labels(outcome).inc()
        PLAN_CAPACITY.set(decision.capacity)
        self._publish_plan()
        log.info(f"controller decision: {decision.plan} reason={decision.reason}",
                 extra={"fields": {"outcome": outcome, "rate": round(load.rate, 3),
                                   "model_prefill_tps": round(self.model.prefill_tokens_per_s),
                                   "chunk_tokens": self.cluster.chunk_tokens,
                                   "busy_prefill_tps": round(self._busy_prefill_rate())}})
        return decision

    def _size_chunk(self) -> None:
        """The colocated chunk the optimizer rates and the actuator sets: the configured one,
        or the largest whose step fits the TPOT SLO under the calibration the loop started
        from. Not under a refit: colocated engines' Stats count the decode time of their
        steps against their prefill rate, so a refit while chunking rates prefill slower,
        which would size a smaller chunk, which would rate it slower still (seen: 176 → 32
        tokens, at ~460 prompt tokens/s)."""
        chunk = self.config.chunk_tokens or colocated_chunk_tokens(
            self.base_model, self.config.slo, ENGINE_CHUNK)
        self.cluster = dataclasses.replace(self.cluster, chunk_tokens=chunk)
        self.actuator.chunk_tokens = chunk

    def _busy_prefill_rate(self) -> float:
        """The highest prefill tokens/s a busy engine (prompts queued) reported in the window,
        0 if none was busy: logged next to the model's rate, whose calibration may not be the
        engines' (another model, another prompt length, cores shared)."""
        return max((s.prefill_tokens_per_s for s in self.monitor.samples()
                    if s.role in ("prefill", "colocated") and s.queue_depth > 0), default=0.0)

    def _publish_plan(self) -> None:
        plan = self.policy.plan
        PLAN_INSTANCES.labels("prefill").set(plan.num_prefill)
        PLAN_INSTANCES.labels("decode").set(plan.num_decode)
        PLAN_INSTANCES.labels("colocated").set(plan.num_colocated)

    async def run_once(self) -> Decision | None:
        """One tick of the loop, guarded: a tick or hook that raises is logged, not raised
        (the loop must outlive any one bad tick); the decision, or None when the tick failed."""
        decision: Decision | None = None
        try:
            decision = await self.tick(time.monotonic())  # the clock ``observe`` uses
        except Exception:  # any bug in one tick; the next may succeed
            log.exception("controller tick failed")
        if self.on_tick is not None:
            try:
                self.on_tick(decision)
            except Exception:  # the hook is the caller's; keep the loop
                log.exception("controller on_tick hook failed")
        return decision

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.run_once()

    def start(self) -> None:
        if self.lease is not None:
            self.lease.start()
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.lease is not None:
            try:
                await self.lease.stop()
            except (redis.exceptions.RedisError, OSError) as exc:  # it expires on its own
                log.warning("controller: lease not released", extra={"fields": {
                    "error": str(exc)}})
