"""Seeded workloads for the simulator: a list of phases, each a prompt/answer mix and a rate.

Lengths are drawn uniformly in [mean/2, 3·mean/2]; arrivals are Poisson, or bursty: gamma
inter-arrival gaps with coefficient of variation ``burst_cv`` (> 1: clumps and lulls).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    rate: float  # requests/s
    input_len: int  # mean prompt tokens
    output_len: int  # mean answer tokens


@dataclass(frozen=True)
class SimRequest:
    rid: int
    t: float
    input_len: int
    output_len: int


# The shifting workload's mixes (rates are set per cluster: see ``evaluate.shifting``).
MIXES: dict[str, tuple[int, int]] = {"chat": (512, 128), "rag": (2048, 64), "long": (256, 768)}


def generate(phases: list[Phase], seed: int, burst_cv: float = 1.0) -> list[SimRequest]:
    """Arrivals of every phase in order; ``burst_cv`` 1 is Poisson."""
    if burst_cv <= 0:
        raise ValueError(f"burst_cv must be > 0, got {burst_cv}")
    rng = np.random.default_rng(seed)
    shape = 1.0 / burst_cv**2
    out: list[SimRequest] = []
    start = 0.0
    for phase in phases:
        if phase.rate <= 0 or phase.duration_s <= 0:
            raise ValueError(f"phase {phase.name}: rate and duration must be > 0")
        t = start
        end = start + phase.duration_s
        while True:
            t += rng.gamma(shape, 1.0 / (shape * phase.rate))
            if t >= end:
                break
            lin = int(rng.integers(phase.input_len // 2, phase.input_len * 3 // 2 + 1))
            lout = int(rng.integers(max(2, phase.output_len // 2), phase.output_len * 3 // 2 + 1))
            out.append(SimRequest(len(out), t, max(1, lin), lout))
        start = end
    return out
