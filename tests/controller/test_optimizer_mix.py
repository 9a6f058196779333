"""The prompt-length mix in the optimizer: the prefill (and colocated prompt) wait is the M/G/1
(Pollaczek-Khinchine) wait from the prompt length's second moment, so a bimodal mix is served at
a lower rate than its mean alone, and a constant mix at the M/D/1 rate (table tests)."""

from __future__ import annotations

import pytest

from pdserve.controller.capacity import CapacityModel
from pdserve.controller.optimizer import Cluster, Slo, colocated_capacity, prefill_capacity
from pdserve.controller.predictor import Load

# 1000 prompt tokens/s, no batch overhead; decode steps 10 ms + 1 ms per sequence, ≤ 40 seqs.
MODEL = CapacityModel(0.0, 1000.0, 0.010, 0.001, max_batch=40)
WITH_OVERHEAD = CapacityModel(0.05, 1000.0, 0.010, 0.001, max_batch=40)
SLO = Slo(ttft_s=1.0, tpot_s=0.050)
CLUSTER = Cluster(10, allow_colocated=False)
# chat and RAG turns alternating, 24 and 900 tokens: mean 462, E[L²] = 405288 (1.90 × 462²)
BIMODAL = Load(1.0, 462.0, 50.0, (24 ** 2 + 900 ** 2) / 2)


@pytest.mark.parametrize(("model", "load", "capacity"), [
    # constant mix, by hand: S = 0.1 s, wait ≤ 1 - 0.111 → ρ/(1-ρ) ≤ 17.78 → 9.4676 req/s
    (MODEL, Load(30, 100, 100), 9.4676),  # second moment unknown: a constant mix
    (MODEL, Load(30, 100, 100, 100 ** 2), 9.4676),  # given, constant: the M/D/1 answer
    # half 20, half 180 tokens: E[L²]/E[L]² = 1.64 → ρ/(1-ρ) ≤ 1.778/0.164 → 9.1555 req/s
    (MODEL, Load(30, 100, 100, (20 ** 2 + 180 ** 2) / 2), 9.1555),
    # 462 tokens: S = 0.462 s, wait ≤ 0.527 s; constant: ρ/(1-ρ) ≤ 2.2814 → 1.5049 req/s;
    # bimodal: ρ/(1-ρ) ≤ 2.2814 / 1.8988 = 1.2015 → 1.1813 req/s (22% less)
    (MODEL, Load(1.0, 462.0, 50.0), 1.5049),
    (MODEL, BIMODAL, 1.1813),
    # a batch overhead is constant: a constant mix still gives the M/D/1 answer with it
    (WITH_OVERHEAD, Load(30, 100, 100), 6.1196),
    (WITH_OVERHEAD, Load(30, 100, 100, 100 ** 2), 6.1196),
    (WITH_OVERHEAD, Load(30, 100, 100, (20 ** 2 + 180 ** 2) / 2), 5.9800),
])
def test_prefill_capacity_sees_the_mix(model: CapacityModel, load: Load,
                                       capacity: float) -> None:
    assert prefill_capacity(model, load, SLO, CLUSTER) == pytest.approx(capacity, rel=1e-3)


def test_a_bimodal_mix_is_served_at_less_than_its_mean_alone() -> None:
    mean_only = Load(BIMODAL.rate, BIMODAL.input_len, BIMODAL.output_len)
    for slo in (SLO, Slo(0.6, 0.1), Slo(2.0, 0.2)):
        assert prefill_capacity(MODEL, BIMODAL, slo, CLUSTER) < \
            0.9 * prefill_capacity(MODEL, mean_only, slo, CLUSTER)
        # colocated: the prompt's wait behind others scales the same way
        assert colocated_capacity(MODEL, BIMODAL, slo, Cluster(10)) < \
            0.95 * colocated_capacity(MODEL, mean_only, slo, Cluster(10))


def test_colocated_capacity_of_a_constant_mix_is_unchanged() -> None:
    constant = Load(1.0, 462.0, 50.0, 462.0 ** 2)
    assert colocated_capacity(MODEL, constant, SLO, Cluster(10)) == \
        colocated_capacity(MODEL, Load(1.0, 462.0, 50.0), SLO, Cluster(10))
