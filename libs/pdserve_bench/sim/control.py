"""The P:D controller inside the simulation: the same ``WorkloadWindow`` forecast and
``Policy`` as pdserve.controller, fed the simulated arrivals; its actuator drains flex
instances towards their new role (``Sim.switch``), least busy first. Each tick is recorded
for the decision-trace plot."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.controller.capacity import CapacityModel
from pdserve.controller.optimizer import Cluster, Plan, Policy, Slo
from pdserve.controller.predictor import Arrival, WorkloadWindow
from pdserve_bench.sim.cluster import Sim
from pdserve_bench.sim.state import Inst
from pdserve_bench.sim.workload import SimRequest


@dataclass(frozen=True)
class TracePoint:
    t: float
    num_prefill: int  # planned (including instances still draining towards it)
    num_decode: int
    forecast_rate: float
    observed_rate: float
    reason: str


class SimController:
    def __init__(self, model: CapacityModel, slo: Slo, cluster: Cluster, initial: Plan,
                 window_s: float = 30.0, horizon_s: float = 10.0, margin: float = 0.1,
                 min_dwell_s: float = 30.0, urgent_dwell_s: float | None = None,
                 stable_s: float = 0.0) -> None:
        self.model, self.slo, self.cluster = model, slo, cluster
        self.window = WorkloadWindow(window_s)
        self.policy = Policy(initial, margin, min_dwell_s, now=0.0, urgent_dwell_s=urgent_dwell_s,
                             stable_s=stable_s)
        self.horizon_s = horizon_s
        self.trace: list[TracePoint] = []

    def observe(self, r: SimRequest) -> None:
        self.window.add(Arrival(r.t, r.input_len, r.output_len))

    def tick(self, sim: Sim, now: float) -> None:
        load = self.window.forecast(now, self.horizon_s)
        if self.policy.urgent_dwell_s < self.policy.min_dwell_s:
            # The requests already queued must be served within the horizon too: a backlog
            # the forecast rate alone does not show makes the plan in force fall short.
            queued = len(sim.backlog["prefill"]) + sum(len(i.queue) for i in sim.insts)
            load = replace(load, rate=load.rate + queued / max(self.horizon_s, 1e-9))
        decision = self.policy.decide(now, self.model, load, self.slo, self.cluster)
        if decision.changed:
            apply(sim, decision.plan)
        planned = [i.planned_role for i in sim.insts]
        self.trace.append(TracePoint(now, planned.count("prefill"), planned.count("decode"),
                                     load.rate, self.window.current(now).rate, decision.reason))


def _busy(inst: Inst) -> int:
    return inst.queued_tokens + 64 * (len(inst.running) + len(inst.waiting))


def apply(sim: Sim, plan: Plan) -> None:
    """Drain the least busy instances of the role that has too many towards the other."""
    planned = [i.planned_role for i in sim.insts]
    excess = planned.count("prefill") - plan.num_prefill
    src, dst = ("prefill", "decode") if excess > 0 else ("decode", "prefill")
    movable = sorted((i for i in sim.insts if i.planned_role == src), key=_busy)
    for inst in movable[:abs(excess)]:
        sim.switch(inst, dst)
