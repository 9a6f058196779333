"""The monitor's window and rates on given samples, and the latency sink's summary."""

from __future__ import annotations

import pytest

from pdserve.controller.monitor import LatencySink, ResourceMonitor, Sample, StatsSource


class _NoSource(StatsSource):
    async def sample(self) -> list[Sample]:
        return []


def _at(t: float, prefill: int, decode: int) -> Sample:
    return Sample("e0", "a", t, "decode", True, False, 0, 1, 10, 2, 0.0, 0.0, prefill, decode, 0)


def test_rates_from_counters_over_the_window() -> None:
    m = ResourceMonitor(_NoSource(), window_s=10)
    m.add(_at(0.0, 0, 0))
    assert m.rates("e0") is None  # one sample: no rate yet
    m.add(_at(5.0, 500, 100))
    m.add(_at(12.0, 1200, 600))  # the sample at 0 falls out of the window
    rates = m.rates("e0")
    assert rates is not None
    assert rates.prefill_tokens_per_s == pytest.approx(700 / 7)
    assert rates.decode_tokens_per_s == pytest.approx(500 / 7)
    assert [s.t for s in m.samples()] == [5.0, 12.0] and m.latest()[0].t == 12.0
    assert m.rates("unknown") is None
    with pytest.raises(ValueError, match="window_s must be > 0"):
        ResourceMonitor(_NoSource(), window_s=0)


def test_latency_sink_percentiles_and_attainment() -> None:
    sink = LatencySink(window_s=60, ttft_slo_s=1.0, tpot_slo_s=0.05)
    assert sink.summary(0).count == 0 and sink.summary(0).slo_attainment is None
    sink.observe(0.0, 5.0, 0.01)  # will fall out of the window
    for i in range(10):
        sink.observe(50.0 + i, 0.1 * (i + 1), 0.04 if i < 8 else 0.08, [0.02, 0.03 * i])
    s = sink.summary(now=70.0)
    assert s.count == 10
    assert s.ttft_p50_s == pytest.approx(0.55)
    assert s.slo_attainment == pytest.approx(0.8)  # TTFT 1.0 is within; two TPOTs are not
    assert s.itl_p99_s == pytest.approx(0.27, abs=0.01)
