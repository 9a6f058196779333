"""Goodput as DistServe defines it: the highest request rate an arrangement serves while the
SLO attainment stays at or above a goal (90% by default).

``evaluate`` measures requests within the SLOs per second at one offered load; that number
cannot exceed the arrival rate, so on a workload every arrangement mostly keeps up with it
cannot tell a split that serves the load with room to spare from one at its limit. Here the
offered load is the variable: every phase's rate is multiplied by one scale ``s`` (the same
seeded workload, re-drawn at each scale), and the largest ``s`` whose run keeps the attainment
goal is found by bisection. Goodput = that scale × the workload's mean arrival rate at scale 1.

Two readings of "keeps the goal", both reported: over the whole run (DistServe's, one trace),
and in **every phase** — an operator's SLO holds over each window of the day, and a split that
fails one phase outright still passes the whole-run goal when that phase is a small share of
the requests. Attainment is assumed to fall as the scale grows (more load, longer queues);
bisection finds the boundary to ``tol`` of the scale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pdserve.controller.capacity import CapacityModel
from pdserve.controller.optimizer import Plan, Slo
from pdserve_bench.sim.control import SimController
from pdserve_bench.sim.evaluate import Result, grid, optimizer_cluster, run
from pdserve_bench.sim.state import SimConfig
from pdserve_bench.sim.workload import Phase, generate

Runner = Callable[[list[Phase]], Result]


@dataclass(frozen=True)
class Search:
    goal: float = 0.9  # the SLO attainment goal
    per_phase: bool = True  # the goal must hold in every phase (else over the whole run)
    lo: float = 0.05  # the smallest scale tried
    hi: float = 4.0  # the largest
    tol: float = 0.02  # bisection stops when hi/lo is within 1 + tol


@dataclass(frozen=True)
class Point:
    name: str
    plan: Plan
    scale: float  # the highest passing scale (0: not even ``lo`` passes)
    goodput: float  # scale × the mean arrival rate at scale 1, req/s
    result: Result | None  # the run at ``scale``
    runs: int  # simulations the search took


def scaled(phases: list[Phase], s: float) -> list[Phase]:
    return [replace(p, rate=p.rate * s) for p in phases]


def passes(r: Result, search: Search) -> bool:
    if search.per_phase:
        return min(r.phase_attainment, default=0.0) >= search.goal
    return r.attainment >= search.goal


def max_scale(runner: Runner, phases: list[Phase], search: Search
              ) -> tuple[float, Result | None, int]:
    """The highest scale of ``phases`` at which ``runner`` keeps the goal (bisection)."""
    runs = 0

    def ok(s: float) -> tuple[bool, Result]:
        nonlocal runs
        runs += 1
        r = runner(scaled(phases, s))
        return passes(r, search), r

    good, best = ok(search.lo)
    if not good:
        return 0.0, None, runs
    lo, hi = search.lo, search.hi
    good, r = ok(hi)
    if good:
        return hi, r, runs
    while hi / lo > 1 + search.tol:
        mid = (lo * hi) ** 0.5  # geometric: the scale spans two orders of magnitude
        good, r = ok(mid)
        if good:
            lo, best = mid, r
        else:
            hi = mid
    return lo, best, runs


def mean_rate(phases: list[Phase]) -> float:
    return sum(p.rate * p.duration_s for p in phases) / sum(p.duration_s for p in phases)


@dataclass
class GoodputEvaluation:
    num_instances: int
    phases: list[Phase]  # at scale 1
    search: Search
    phase1_best: Point  # the fixed split with the highest phase-1 goodput, phase 1 alone
    points: list[Point]  # the whole workload

    def by_name(self, name: str) -> Point:
        return next(p for p in self.points if p.name == name)

    def ratio(self) -> float | None:
        fixed = self.by_name("fixed, best for phase 1").goodput
        return self.by_name("controller").goodput / fixed if fixed else None

    def to_json(self) -> dict[str, Any]:
        def point(p: Point) -> dict[str, Any]:
            r = p.result
            return {"name": p.name, "num_prefill": p.plan.num_prefill,
                    "num_decode": p.plan.num_decode, "num_colocated": p.plan.num_colocated,
                    "scale": p.scale, "goodput": p.goodput, "runs": p.runs,
                    "attainment": r.attainment if r else None,
                    "phase_attainment": r.phase_attainment if r else None,
                    "switches": _switches(r)}
        return {"num_instances": self.num_instances, "goal": self.search.goal,
                "per_phase": self.search.per_phase,
                "phases": [p.__dict__ for p in self.phases],
                "phase1_best": point(self.phase1_best),
                "points": [point(p) for p in self.points],
                "controller_vs_phase1_fixed": self.ratio()}


def _switches(r: Result | None) -> int | None:
    if r is None or not r.trace:
        return None
    plans = [(t.num_prefill, t.num_decode) for t in r.trace]
    return sum(a != b for a, b in zip(plans, plans[1:], strict=False))


def evaluate_goodput(n: int, phases: list[Phase], model: CapacityModel, cfg: SimConfig,
                     slo: Slo, controller_args: dict[str, Any], search: Search, seed: int,
                     burst_cv: float = 1.0, grid_steps: int = 7, tick_s: float = 10.0,
                     hindsight: bool = False) -> GoodputEvaluation:
    """The phase-1 fixed split (best phase-1 goodput of the grid), then that split, colocated
    and the controller (starting from that split) on the whole workload; ``hindsight`` adds the
    fixed split with the best whole-workload goodput (a search per grid point)."""
    def fixed(plan: Plan, name: str) -> Runner:
        return lambda ph: run(name, plan, generate(ph, seed, burst_cv), ph, model, cfg, slo)

    def point(name: str, plan: Plan, runner: Runner, ph: list[Phase]) -> Point:
        s, r, k = max_scale(runner, ph, search)
        return Point(name, plan, s, s * mean_rate(ph), r, k)

    first = phases[:1]
    p1 = max((point(f"p={p}", Plan(p, n - p), fixed(Plan(p, n - p), f"p={p}"), first)
              for p in grid(n, grid_steps)), key=lambda pt: pt.goodput)
    plan1 = p1.plan

    def controlled(ph: list[Phase]) -> Result:
        ctl = SimController(model, slo, optimizer_cluster(n, cfg), plan1, **controller_args)
        return run("controller", plan1, generate(ph, seed, burst_cv), ph, model, cfg, slo, ctl,
                   tick_s=tick_s)

    colocated = Plan(0, 0, n)
    points = [point("fixed, best for phase 1", plan1, fixed(plan1, "fixed"), phases),
              point("colocated", colocated, fixed(colocated, "colocated"), phases),
              point("controller", plan1, controlled, phases)]
    if hindsight:
        others = [point(f"fixed p={p} d={n - p}", Plan(p, n - p),
                        fixed(Plan(p, n - p), "fixed"), phases)
                  for p in grid(n, grid_steps) if p != plan1.num_prefill]
        best = max(others, key=lambda pt: pt.goodput, default=None)
        if best is not None:
            points.insert(1, replace(best, name=f"fixed, best in hindsight ({best.name[6:]})"))
    return GoodputEvaluation(n, phases, search, p1, points)


def format_goodput(e: GoodputEvaluation) -> str:
    where = "every phase" if e.search.per_phase else "the whole run"
    names = [p.name for p in e.phases]
    head = (f"{'arrangement':<38} {'p':>4} {'d':>4} {'colo':>4} {'scale':>6} {'goodput':>8} "
            + " ".join(f"{n:>7}" for n in names) + f" {'runs':>4}")
    lines = [f"goodput: the highest rate with SLO attainment >= {e.search.goal:.0%} in {where} "
             f"(attainment by phase at that rate)", head]
    for p in e.points:
        att = p.result.phase_attainment if p.result else [0.0] * len(names)
        lines.append(f"{p.name:<38} {p.plan.num_prefill:>4} {p.plan.num_decode:>4} "
                     f"{p.plan.num_colocated:>4} {p.scale:>6.3f} {p.goodput:>8.2f} "
                     + " ".join(f"{a:>7.1%}" for a in att) + f" {p.runs:>4}")
    ratio = e.ratio()
    lines.append(f"controller / fixed best for phase 1: {ratio:.2f}x" if ratio is not None
                 else "controller / fixed best for phase 1: - (the fixed split never passes)")
    return "\n".join(lines)
