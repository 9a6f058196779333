"""Ratio optimizer: for a predicted load, the (prefill, decode) split — or colocated — of N
instances that serves the most requests per second within the TTFT and TPOT SLOs, from the
calibrated ``CapacityModel``; and a ``Policy`` that adopts a new plan only past a margin and a
minimum dwell time (hysteresis: it never flaps), and that may prefer a split while it keeps up.

Per-instance capacity under the SLOs (requests/s), each a closed form or a bisection:

    prefill    the rate at which the M/G/1 wait + service + KV transfer + one decode step ≤
               TTFT; the wait is Pollaczek-Khinchine's, W = λ·E[S²] / (2(1 - ρ)), E[S²] from
               the prompt length's second moment (a constant mix: the M/D/1 wait)
    decode     b_max = the largest batch whose step time ≤ TPOT (≤ max_batch);
               rate = b_max / (step(b_max) · output_len)            (Little's law)
    colocated  chunked prefill rides in decode steps: prefill takes u = λ·L_in / r_p of the time,
               TPOT = step(b) / (1 - u), b = λ·L_out·TPOT; TTFT = the M/G/1 wait at u + the
               prompt's chunks, each a step carrying ``chunk_tokens`` (the controller sizes
               it from the TPOT SLO: ``colocated_chunk_tokens``)

A disaggregated split serves min(p·cap_prefill, d·cap_decode); colocated N·cap_colocated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.controller.capacity import CapacityModel
from pdserve.controller.predictor import Load


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLOs must be > 0 (ttft {self.ttft_s}, tpot {self.tpot_s})")


@dataclass(frozen=True)
class Plan:
    """Colocated when ``num_prefill == num_decode == 0`` and ``num_colocated`` > 0."""

    num_prefill: int
    num_decode: int
    num_colocated: int = 0

    @property
    def is_colocated(self) -> bool:
        return self.num_colocated > 0

    def __str__(self) -> str:
        split = f"p={self.num_prefill} d={self.num_decode}"
        if not self.is_colocated:
            return split
        colocated = f"colocated={self.num_colocated}"
        # A mix (engines left half way through a switch) is no plan the optimizer offers.
        return f"{split} {colocated}" if self.num_prefill or self.num_decode else colocated


ENGINE_CHUNK = 512  # the engine service's default --max-num-batched-tokens


@dataclass(frozen=True)
class Cluster:
    """What the optimizer may arrange: ``num_instances`` engines and the cost of moving KV."""

    num_instances: int
    transfer_s_per_token: float = 0.0  # KV bytes per token / link bandwidth
    chunk_tokens: int = ENGINE_CHUNK  # colocated: prompt tokens a step carries
    allow_colocated: bool = True


MIN_CHUNK = 16  # tokens: below it a step re-reads the weights for almost no prompt work


def colocated_chunk_tokens(m: CapacityModel, slo: Slo, most: int) -> int:
    """The prompt tokens a colocated step may carry so that the step — a decode step plus the
    chunk — stays within the TPOT SLO (Sarathi-Serve's token budget from the inter-token
    latency objective): (TPOT - step(1)) · prefill rate in whole tokens, at least ``MIN_CHUNK``
    and at most ``most`` (the engines' own budget).

    Not rounded to whole KV blocks (it was, to 16 tokens): a measured rate that varies ±7%
    between starts of the same engine then moved the chunk by a quarter (48 or 64 tokens at
    ~800 tokens/s), and with it how many steps a long prompt takes against the TTFT SLO. The
    engine takes a chunk that ends inside a block as it takes any prompt that does."""
    fits = (slo.tpot_s - m.step_time(1)) * m.prefill_tokens_per_s
    return max(MIN_CHUNK, min(most, int(fits)))


def _mg1_wait(rho: float, service_s: float, scv_factor: float) -> float:
    """Mean queueing delay of an M/G/1 queue at utilization ``rho`` whose mean service time is
    ``service_s`` (Pollaczek-Khinchine): λ·E[S²] / (2(1 - ρ)) = ρ·E[S]·(E[S²]/E[S]²) / (2(1 - ρ));
    ``scv_factor`` = E[S²]/E[S]² (1 for a constant service time: the M/D/1 wait)."""
    return math.inf if rho >= 1 else rho * service_s * scv_factor / (2 * (1 - rho))


def _len_scv_factor(load: Load) -> float:
    """E[L²]/E[L]² of the prompt length: E[S²]/E[S]² of a service time proportional to it."""
    return load.input_len_2nd / load.input_len ** 2 if load.input_len > 0 else 1.0


def _prefill_scv_factor(m: CapacityModel, load: Load) -> float:
    """E[S²]/E[S]² of a prefill, S = overhead + L / rate: the overhead is constant, so
    E[S²] = o² + 2o·E[L]/r + E[L²]/r²."""
    o, r = m.prefill_overhead_s, m.prefill_tokens_per_s
    mean = m.prefill_time(load.input_len)
    return (o * o + 2 * o * load.input_len / r + load.input_len_2nd / r ** 2) / mean ** 2


def _max_rate(ok: Callable[[float], bool], hi: float) -> float:
    """The largest rate in [0, hi] for which ``ok(rate)`` holds (monotone), by bisection."""
    if not ok(1e-9):
        return 0.0
    lo = 1e-9
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def prefill_capacity(m: CapacityModel, load: Load, slo: Slo, cluster: Cluster) -> float:
    service = m.prefill_time(load.input_len)
    fixed = service + cluster.transfer_s_per_token * load.input_len + m.step_time(1)
    scv = _prefill_scv_factor(m, load)
    return _max_rate(lambda r: fixed + _mg1_wait(r * service, service, scv) <= slo.ttft_s,
                     1 / service)


def decode_capacity(m: CapacityModel, load: Load, slo: Slo) -> float:
    if m.decode_per_seq_s > 0:
        b_max = min(m.max_batch, math.floor((slo.tpot_s - m.decode_base_s) / m.decode_per_seq_s))
    else:
        b_max = m.max_batch if m.decode_base_s <= slo.tpot_s else 0
    if b_max < 1:
        return 0.0
    return b_max / (m.step_time(b_max) * max(1.0, load.output_len))


def _colocated_ok(m: CapacityModel, load: Load, slo: Slo, chunk: int, rate: float) -> bool:
    u = rate * load.input_len / m.prefill_tokens_per_s
    if u >= 1:
        return False
    # b = rate·L_out·step(b)/(1-u) solved for b (linear in b)
    k = rate * max(1.0, load.output_len) / (1 - u)
    if k * m.decode_per_seq_s >= 1:
        return False
    batch = k * m.decode_base_s / (1 - k * m.decode_per_seq_s)
    if batch > m.max_batch:
        return False
    step = m.step_time(batch)
    num_chunks = max(1, math.ceil(load.input_len / chunk))
    prompt = num_chunks * step + load.input_len / m.prefill_tokens_per_s
    # A prompt's time is about proportional to its length (its chunks and its tokens), so the
    # wait behind prompts of a mix scales with the length's E[L²]/E[L]².
    return step / (1 - u) <= slo.tpot_s and \
        prompt + _mg1_wait(u, prompt, _len_scv_factor(load)) <= slo.ttft_s


def colocated_capacity(m: CapacityModel, load: Load, slo: Slo, cluster: Cluster) -> float:
    hi = m.prefill_tokens_per_s / max(1.0, load.input_len)
    return _max_rate(lambda r: _colocated_ok(m, load, slo, cluster.chunk_tokens, r), hi)


@dataclass(frozen=True)
class Scored:
    plan: Plan
    capacity: float  # requests/s the plan serves within the SLOs


def score(plan: Plan, m: CapacityModel, load: Load, slo: Slo, cluster: Cluster) -> Scored:
    if plan.is_colocated:
        return Scored(plan, plan.num_colocated * colocated_capacity(m, load, slo, cluster))
    return Scored(plan, min(plan.num_prefill * prefill_capacity(m, load, slo, cluster),
                            plan.num_decode * decode_capacity(m, load, slo)))


def best_split(m: CapacityModel, load: Load, slo: Slo, cluster: Cluster) -> Scored | None:
    """The disaggregated plan of the most capacity (ties: fewer prefill instances); None with
    fewer than two instances."""
    n = cluster.num_instances
    p_cap, d_cap = prefill_capacity(m, load, slo, cluster), decode_capacity(m, load, slo)
    best: Scored | None = None
    for p in range(1, n):
        s = Scored(Plan(p, n - p), min(p * p_cap, (n - p) * d_cap))
        if best is None or s.capacity > best.capacity:
            best = s
    return best


def best_plan(m: CapacityModel, load: Load, slo: Slo, cluster: Cluster) -> Scored:
    """The plan of the most capacity (ties: fewer prefill instances, then disaggregated)."""
    n = cluster.num_instances
    if n < 1:
        raise ValueError(f"num_instances must be >= 1, got {n}")
    best = best_split(m, load, slo, cluster)
    if cluster.allow_colocated or best is None:
        colo = score(Plan(0, 0, n), m, load, slo, cluster)
        if best is None or colo.capacity > best.capacity:
            best = colo
    return best


PREFERENCES = ("goodput", "split")


@dataclass(frozen=True)
class Decision:
    plan: Plan
    changed: bool
    reason: str
    load: Load
    capacity: float  # of the plan kept or adopted, at this load


class Policy:
    """Adopts the optimizer's plan only when it serves ≥ (1 + margin)× the current plan's
    capacity at the predicted load and the current plan has been kept ``min_dwell_s`` — or,
    with ``urgent_dwell_s`` set, only that long while the forecast load exceeds what the current
    plan serves (its queues grow every second it stays; the better plan must still clear the
    margin, so two plans that both fall short do not alternate).

    ``stable_s`` is a stabilization window (as Kubernetes' autoscaler has): while the plan in
    force still serves the forecast load, a new plan is adopted only once it has been the best
    one, past the margin, at every decision for ``stable_s`` — a mix that wobbles with the
    sampling noise of a short window then moves nothing. An overloaded plan is not held by it
    when the new plan serves the load; when both fall short, a move only trades one shortfall
    for another, and the window holds it as any other (two short plans whose ranking follows
    the window's mean prompt length otherwise alternate at every dwell, each move a drain).

    ``prefer``: "goodput" aims at the plan of the most capacity (above). "split" aims at the
    best disaggregated plan whenever it serves ≥ the forecast load × (1 + ``headroom``) —
    disaggregation is run for its inter-token latency, which colocated plans give up — and at
    the plan of the most capacity only when no split keeps up. A split in force is kept while
    it serves the load itself (a band between load and load × (1 + headroom), so a load near
    the split's capacity does not move the engines back and forth). A move to the preferred
    split needs no capacity margin (it trades capacity for latency by design); dwell and
    stabilization apply as to any move.
    """

    def __init__(self, initial: Plan, margin: float = 0.1, min_dwell_s: float = 30.0,
                 now: float = 0.0, urgent_dwell_s: float | None = None,
                 stable_s: float = 0.0, prefer: str = "goodput", headroom: float = 0.2) -> None:
        if margin < 0 or min_dwell_s < 0 or (urgent_dwell_s or 0) < 0 or stable_s < 0 \
                or headroom < 0:
            raise ValueError("margin, min_dwell_s, urgent_dwell_s, stable_s and headroom must be "
                             ">= 0")
        if prefer not in PREFERENCES:
            raise ValueError(f"prefer must be one of {', '.join(PREFERENCES)}, got {prefer!r}")
        self.plan, self.margin, self.min_dwell_s = initial, margin, min_dwell_s
        self.urgent_dwell_s = min_dwell_s if urgent_dwell_s is None else urgent_dwell_s
        self.stable_s, self.prefer, self.headroom = stable_s, prefer, headroom
        self.changed_at = now
        self._candidate: tuple[Plan, float] | None = None  # the better plan, best since when

    def _target(self, m: CapacityModel, load: Load, slo: Slo, cluster: Cluster,
                current: Scored, best: Scored) -> tuple[Scored, str, bool]:
        """The plan to aim at, the preference rule that chose it ("" without one) and whether
        the preference chose it (then no capacity margin applies to the move)."""
        split = best_split(m, load, slo, cluster) if self.prefer == "split" else None
        if split is None:
            return best, "", False
        if not self.plan.is_colocated and current.capacity >= load.rate:
            better = split.capacity >= current.capacity * (1 + self.margin)
            kept = split if better else current
            return kept, (f"split keeps up: {kept.plan} serves {kept.capacity:.2f} ≥ load "
                          f"{load.rate:.2f}"), True
        if split.capacity >= load.rate * (1 + self.headroom):
            return split, (f"split keeps up: {split.plan} serves {split.capacity:.2f} ≥ load "
                           f"{load.rate:.2f} × {1 + self.headroom:g}"), True
        return best, (f"split short: {split.plan} serves {split.capacity:.2f} < load "
                      f"{load.rate:.2f} × {1 + self.headroom:g}, most goodput"), False

    def decide(self, now: float, m: CapacityModel, load: Load, slo: Slo,
               cluster: Cluster) -> Decision:
        if load.rate <= 0:  # no arrivals, or a falling trend clamped at 0: nothing to plan for
            self._candidate = None
            return Decision(self.plan, False, "hold: no load forecast (0 req/s)", load, 0.0)
        current = score(self.plan, m, load, slo, cluster)
        best = best_plan(m, load, slo, cluster)
        target, rule, preferred = self._target(m, load, slo, cluster, current, best)
        what = (f"load {load.rate:.2f} req/s in {load.input_len:.0f}/{load.output_len:.0f} "
                f"tokens: best {best.plan} serves {best.capacity:.2f}, {self.plan} serves "
                f"{current.capacity:.2f}")
        if rule:
            what = f"{rule}; {what}"

        def hold(why: str) -> Decision:
            return Decision(self.plan, False, f"{why}: {what}", load, current.capacity)

        if target.plan == self.plan or \
                (not preferred and target.capacity < current.capacity * (1 + self.margin)):
            self._candidate = None
            return hold("hold" if target.plan == self.plan else
                        f"hold (within {self.margin:.0%} margin)")
        if self._candidate is None or self._candidate[0] != target.plan:
            self._candidate = (target.plan, now)
        overloaded = load.rate > current.capacity
        stable_for = now - self._candidate[1]
        if stable_for < self.stable_s and (not overloaded or target.capacity < load.rate):
            return hold(f"hold (best for {stable_for:.0f}s < {self.stable_s:.0f}s)")
        dwell = self.urgent_dwell_s if overloaded else self.min_dwell_s
        if now - self.changed_at < dwell:
            return hold(f"hold (dwell {now - self.changed_at:.0f}s < {dwell:.0f}s)")
        self.plan, self.changed_at, self._candidate = target.plan, now, None
        return Decision(target.plan, True, f"switch: {what}", load, target.capacity)
