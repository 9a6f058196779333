"""Capacity model: least-squares calibration from bench output and from Stats samples."""

from __future__ import annotations

import json

import pytest

from pdserve.controller.capacity import (
    CalibrationError,
    CapacityModel,
    fit,
    fit_line,
    from_bench_lines,
    from_stats,
)
from pdserve.controller.monitor import Sample


def _sample(role: str, queue: int, running: int, p_tps: float, d_tps: float) -> Sample:
    return Sample("e", "a", 0.0, role, True, False, queue, running, 10, 2, p_tps, d_tps, 0, 0, 0)


def test_fit_recovers_exact_laws() -> None:
    # 5 ms + T/2000 s per prefill batch; 10 ms + 1 ms·b per decode step
    prefill = [(t, 0.005 + t / 2000) for t in (128, 512, 2048)]
    decode = [(b, 0.010 + 0.001 * b) for b in (1, 8, 32)]
    m = fit(prefill, decode, max_batch=48)
    assert m.prefill_overhead_s == pytest.approx(0.005)
    assert m.prefill_tokens_per_s == pytest.approx(2000)
    assert m.decode_base_s == pytest.approx(0.010)
    assert m.decode_per_seq_s == pytest.approx(0.001)
    assert m.step_time(10) == pytest.approx(0.020) and m.max_batch == 48
    assert m.prefill_time(2000) == pytest.approx(1.005)


def test_fit_is_least_squares_over_noise() -> None:
    points = [(1, 1.1), (2, 1.9), (3, 3.1), (4, 3.9)]
    intercept, slope = fit_line(points, "decode")
    assert slope == pytest.approx(0.96) and intercept == pytest.approx(0.1)


def test_from_bench_lines_uses_the_bench_json() -> None:
    rows = [{"num_seqs": 1, "pdserve_decode_tps": 100.0, "hf_decode_tps": 1,
             "pdserve_prefill_tps": 1000.0, "hf_prefill_tps": 1},
            {"num_seqs": 31, "pdserve_decode_tps": 775.0, "hf_decode_tps": 1,
             "pdserve_prefill_tps": 1000.0, "hf_prefill_tps": 1}]
    lines = ["bench-50m, float32, 2 threads", *map(json.dumps, rows)]
    m = from_bench_lines(lines, prompt_len=128, max_batch=64)
    # decode steps: 1/100 = 10 ms at 1, 31/775 = 40 ms at 31 → 9 ms + 1 ms·b
    assert m.decode_base_s == pytest.approx(0.009) and m.decode_per_seq_s == pytest.approx(0.001)
    assert m.prefill_tokens_per_s == pytest.approx(1000)
    assert m.prefill_overhead_s == pytest.approx(0, abs=1e-9)


def test_step_time_follows_the_measured_points_inside_their_range() -> None:
    # steps of 20, 38, 50 ms at 1, 4, 8 sequences: not a line
    rows = [{"num_seqs": b, "pdserve_decode_tps": b / t, "pdserve_prefill_tps": 1000.0}
            for b, t in ((1, 0.020), (4, 0.038), (8, 0.050))]
    m = from_bench_lines(map(json.dumps, rows), prompt_len=128, max_batch=64)
    assert [b for b, _ in m.decode_points] == [1, 4, 8]
    assert [t for _, t in m.decode_points] == pytest.approx([0.020, 0.038, 0.050])
    assert m.step_time(1) == pytest.approx(0.020) and m.step_time(4) == pytest.approx(0.038)
    assert m.step_time(6) == pytest.approx(0.044)  # halfway between 4 and 8
    # outside the measured batches, the fitted line
    assert m.step_time(16) == pytest.approx(m.decode_base_s + 16 * m.decode_per_seq_s)
    assert m.step_time(0) == pytest.approx(m.decode_base_s)


@pytest.mark.parametrize(("lines", "message"), [
    (['{"num_seqs": 1, "pdserve_decode_tps": 90, "pdserve_prefill_tps": 900}'],
     "need points at two or more distinct sizes"),
    (['{"num_seqs": 1, "decode_tps": 90}'], "line 1 lacks 'pdserve_prefill_tps'"),
    (['{"num_seqs": 1, "pdserve_decode_tps": 90, "pdserve_prefill_tps": 900}',
      '{"num_seqs": 8, "pdserve_decode_tps": 8, "pdserve_prefill_tps": 900}'],
     "decode: the fitted base step time is 0"),  # 1 s steps at 8: inconsistent with 11 ms at 1
])
def test_from_bench_lines_errors(lines: list[str], message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        from_bench_lines(lines, 128, 64)


def test_from_stats_fits_busy_samples_only() -> None:
    samples = [
        _sample("decode", 0, 4, 0, 4 / 0.014),  # 14 ms steps at 4
        _sample("decode", 0, 20, 0, 20 / 0.030),  # 30 ms steps at 20
        _sample("decode", 0, 0, 0, 0),  # idle: ignored
        _sample("prefill", 3, 1, 1800.0, 0),
        _sample("prefill", 1, 1, 2200.0, 0),
        _sample("prefill", 0, 0, 50.0, 0),  # not busy: its rate is the load, not capacity
    ]
    m = from_stats(samples, max_batch=32)
    assert m.decode_base_s == pytest.approx(0.010) and m.decode_per_seq_s == pytest.approx(0.001)
    assert m.prefill_tokens_per_s == pytest.approx(2000)
    with pytest.raises(CalibrationError, match="no busy prefill sample"):
        from_stats(samples[:3], max_batch=32)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prefill_tokens_per_s": 0.0}, "prefill tokens/s"),
    ({"decode_per_seq_s": -1.0}, "must be >= 0"),
])
def test_model_validates(kwargs: dict, message: str) -> None:
    fields = {"prefill_overhead_s": 0.0, "prefill_tokens_per_s": 1000.0, "decode_base_s": 0.01,
              "decode_per_seq_s": 0.001, **kwargs}
    with pytest.raises(CalibrationError, match=message):
        CapacityModel(**fields)
