"""``Policy(prefer="split")``: the best split while it keeps up with the forecast load × (1 +
headroom), the plan of most goodput only when it does not; a split in force kept while it
serves the load; dwell and stabilization as before (table tests)."""

from __future__ import annotations

import pytest

from pdserve.controller.capacity import CapacityModel
from pdserve.controller.optimizer import Cluster, Plan, Policy, Slo
from pdserve.controller.predictor import Load

# 1000 prompt tokens/s, no batch overhead; decode steps 10 ms + 1 ms per sequence, ≤ 40 seqs.
MODEL = CapacityModel(0.0, 1000.0, 0.010, 0.001, max_batch=40)
SLO = Slo(ttft_s=1.0, tpot_s=0.050)
TWO = Cluster(2)
SPLIT, COLOCATED = Plan(1, 1), Plan(0, 0, 2)


def long_answers(rate: float) -> Load:
    """100-token prompts, 1000-token answers: 1P+1D serves 0.80 req/s (decode-bound: 40 seqs /
    (50 ms · 1000)), colocated=2 serves 1.45 — the plan of most goodput."""
    return Load(rate, 100, 1000)


@pytest.mark.parametrize(("prefer", "plan", "rate", "after", "reason"), [
    # colocated in force, the split keeps up with the headroom: back to the split
    ("split", COLOCATED, 0.5, SPLIT,
     "switch: split keeps up: p=1 d=1 serves 0.80 ≥ load 0.50 × 1.2; load 0.50 req/s in "
     "100/1000 tokens: best colocated=2 serves 1.45, colocated=2 serves 1.45"),
    ("goodput", COLOCATED, 0.5, COLOCATED, "hold: load 0.50 req/s in 100/1000 tokens: "),
    # the split would keep up, but not with the headroom: colocated stays
    ("split", COLOCATED, 0.7, COLOCATED,
     "hold: split short: p=1 d=1 serves 0.80 < load 0.70 × 1.2, most goodput; load 0.70"),
    # the split in force serves the load (the band between load and load × 1.2): kept
    ("split", SPLIT, 0.7, SPLIT,
     "hold: split keeps up: p=1 d=1 serves 0.80 ≥ load 0.70; load 0.70"),
    ("goodput", SPLIT, 0.7, COLOCATED, "switch: load 0.70 req/s"),
    # the split in force cannot serve the load: the plan of most goodput, past the margin
    ("split", SPLIT, 0.9, COLOCATED,
     "switch: split short: p=1 d=1 serves 0.80 < load 0.90 × 1.2, most goodput; load 0.90"),
])
def test_split_preference_table(prefer: str, plan: Plan, rate: float, after: Plan,
                                reason: str) -> None:
    policy = Policy(plan, margin=0.1, min_dwell_s=0, now=0, prefer=prefer, headroom=0.2)
    d = policy.decide(100, MODEL, long_answers(rate), SLO, TWO)
    assert d.plan == after and d.changed == (after != plan)
    assert d.reason.startswith(reason), d.reason


def test_split_preference_picks_the_best_split_of_many() -> None:
    # 10 instances, chat 100/100 at 30 req/s under a loose TPOT: colocated=10 serves the most
    # (44.4), p=5 d=5 serves 40 ≥ 30 × 1.2, so that split is chosen (over p=4 d=6's 37.9, ...)
    chat, loose = Load(30, 100, 100), Slo(1.0, 0.2)
    policy = Policy(Plan(0, 0, 10), 0.1, 0.0, prefer="split")
    d = policy.decide(100, MODEL, chat, loose, Cluster(10))
    assert d.changed and d.plan == Plan(5, 5) and d.capacity == pytest.approx(40.0)
    assert "best colocated=10" in d.reason
    # and a split in force that keeps up moves only to a split better by the margin
    kept = Policy(Plan(4, 6), 0.1, 0.0, prefer="split").decide(100, MODEL, chat, loose,
                                                                Cluster(10))
    assert not kept.changed and kept.reason.startswith("hold: split keeps up: p=4 d=6 serves 37")


def test_split_preference_keeps_dwell_and_stabilization() -> None:
    policy = Policy(COLOCATED, margin=0.1, min_dwell_s=30, now=0, prefer="split", stable_s=5)
    d = policy.decide(10, MODEL, long_answers(0.5), SLO, TWO)
    assert not d.changed and d.reason.startswith("hold (best for 0s < 5s): split keeps up")
    d = policy.decide(16, MODEL, long_answers(0.5), SLO, TWO)
    assert not d.changed and d.reason.startswith("hold (dwell 16s < 30s): split keeps up")
    assert policy.decide(31, MODEL, long_answers(0.5), SLO, TWO).plan == SPLIT
    # the load outgrows the split at once: overloaded, so no stabilization, but the dwell holds
    d = policy.decide(35, MODEL, long_answers(0.9), SLO, TWO)
    assert not d.changed and d.reason.startswith("hold (dwell 4s < 30s): split short")
    d = policy.decide(61, MODEL, long_answers(0.9), SLO, TWO)
    assert d.changed and d.plan == COLOCATED
    # a load inside the band (0.8 ≥ 0.7, but < 0.7 × 1.2) does not bring the split back
    for t in range(100, 200, 10):
        assert not policy.decide(t, MODEL, long_answers(0.7), SLO, TWO).changed


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prefer": "fast"}, "prefer must be one of goodput, split, got 'fast'"),
    ({"headroom": -0.1}, "margin, min_dwell_s, urgent_dwell_s, stable_s and headroom must be"),
])
def test_bad_preference_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Policy(SPLIT, **kwargs)
