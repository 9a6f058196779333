"""Workload predictor: Holt's trend forecast, bucketed rates, the sliding window (table tests)."""

from __future__ import annotations

import random

import pytest

from pdserve.controller.predictor import Arrival, Load, WorkloadWindow, bucket_rates, holt


@pytest.mark.parametrize(("series", "alpha", "beta", "horizon", "expected"), [
    ([5.0, 5.0, 5.0, 5.0], 0.5, 0.3, 3, 5.0),  # flat stays flat
    ([1.0, 2.0, 3.0, 4.0], 0.5, 0.3, 1, 5.0),  # an exact line is extrapolated exactly
    ([1.0, 2.0, 3.0, 4.0], 0.5, 0.3, 4, 8.0),
    ([10.0, 8.0, 6.0, 4.0], 1.0, 1.0, 10, 0.0),  # a falling rate never forecasts below zero
    ([7.0], 0.5, 0.3, 5, 7.0),  # one point: no trend
    ([0.0, 0.0, 0.0, 10.0], 1.0, 0.0, 2, 10.0),  # beta 0 keeps the first trend (0), alpha 1 jumps
])
def test_holt_table(series: list[float], alpha: float, beta: float, horizon: float,
                    expected: float) -> None:
    assert holt(series, alpha, beta, horizon) == pytest.approx(expected)


def test_holt_follows_a_step_with_its_trend() -> None:
    # A step up: the forecast overshoots the last value (the trend), unlike a plain EWMA.
    assert holt([1, 1, 1, 5, 9], 0.8, 0.5, 1) > 9


@pytest.mark.parametrize(("args", "message"), [
    (([], 0.5, 0.3, 1), "the series is empty"),
    (([1.0], 0.0, 0.3, 1), "alpha must be in (0, 1]"),
    (([1.0], 0.5, 1.5, 1), "beta in [0, 1]"),
])
def test_holt_rejects_bad_input(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        holt(*args)


def test_bucket_rates() -> None:
    assert bucket_rates([0.1, 0.2, 1.5, 3.9, 4.0, -1], 0, 4, 2) == [1.5, 0.5]
    with pytest.raises(ValueError, match="need end > start"):
        bucket_rates([], 4, 4, 2)


def test_window_mean_and_trim() -> None:
    w = WorkloadWindow(window_s=10)
    for i in range(20):  # one a second, prompts 100 then 300
        w.add(Arrival(float(i), 100 if i < 10 else 300, 50))
    load = w.current(now=19.5)  # arrivals 10..19 remain
    assert load == Load(1.0, 300.0, 50.0, 300.0 ** 2)  # a constant mix: E[L²] = E[L]²
    assert w.current(now=100.0) == Load(0.0, 0.0, 0.0)


def test_window_carries_the_prompt_lengths_second_moment() -> None:
    w = WorkloadWindow(window_s=10, min_mix_arrivals=4)
    for i in range(10):  # chat and RAG turns alternating: 24 and 900 tokens
        w.add(Arrival(float(i), 24 if i % 2 else 900, 50))
    load = w.current(now=9.5)
    assert load.input_len == 462.0
    assert load.input_len_sq == (24 ** 2 + 900 ** 2) / 2 == load.input_len_2nd
    assert load.input_len_2nd > 1.85 * load.input_len ** 2  # E[L²]/E[L]² = 1.90
    forecast = w.forecast(now=9.5, horizon_s=2.0)  # the recent half: 5..9, three 24s, two 900s
    assert forecast.input_len_sq == (3 * 24 ** 2 + 2 * 900 ** 2) / 5


def test_an_unknown_second_moment_reads_as_a_constant_mix() -> None:
    assert Load(1.0, 300.0, 50.0).input_len_2nd == 300.0 ** 2
    assert Load(1.0, 300.0, 50.0, 100.0).input_len_2nd == 300.0 ** 2  # below E[L]²: noise


def test_window_forecast_extrapolates_a_ramp_and_follows_the_mix() -> None:
    w = WorkloadWindow(window_s=6, num_buckets=6, alpha=0.9, beta=0.9, min_mix_arrivals=8)
    t = 0.0
    for second in range(6):  # 1, 2, ... 6 arrivals per second
        for k in range(second + 1):
            w.add(Arrival(t + second + k / (second + 1), 100 if second < 3 else 900, 10 * second))
    forecast = w.forecast(now=6.0, horizon_s=2.0)
    assert forecast.rate > 6.5  # beyond the last bucket's 6/s
    assert forecast.input_len == 900  # the recent half's mix
    assert w.current(6.0).rate == pytest.approx(21 / 6)


def test_a_steady_poisson_load_never_forecasts_zero() -> None:
    # The controller's own settings (6 s window, 1 s buckets, 1 s ticks) at a steady
    # 1 req/s: Holt's trend on the buckets' noise alone fell to 0 on many ticks.
    rng = random.Random(0)
    w, t, arrivals = WorkloadWindow(window_s=6, num_buckets=6), 0.0, []
    while t < 300:
        t += rng.expovariate(1.0)
        arrivals.append(t)
    rates, means, i = [], [], 0
    for now in range(10, 290):
        while arrivals[i] < now:
            w.add(Arrival(arrivals[i], 100, 10))
            i += 1
        rates.append(w.forecast(float(now), horizon_s=1.0).rate)
        means.append(w.current(float(now)).rate)
        assert rates[-1] >= means[-1]  # the floor: the window's mean
    # 0 only when 6 s passed without an arrival (e^-6 of ticks at 1 req/s).
    assert [r for r, m in zip(rates, means, strict=True) if r == 0 and m > 0] == []
    assert sum(r == 0 for r in rates) <= 3
    assert sorted(rates)[len(rates) // 2] == pytest.approx(1.0, abs=0.35)
    # A real fall still shows within one window: no arrivals for 6 s is no load.
    assert w.forecast(296.0, 1.0).rate < 0.5 and w.forecast(400.0, 1.0).rate == 0.0


def test_a_steady_mix_is_read_from_enough_requests() -> None:
    # `mixed` at 1 req/s: chat (24 tokens) and RAG (900) prompts drawn at random. The latest
    # half of a 6 s window holds 1-3 of them, too few to say the mix; the last 16 are enough.
    rng = random.Random(1)
    arrivals = [Arrival(t + rng.random(), rng.choice((24, 900)), 8) for t in range(200)]
    means = {}
    for k in (1, 16):
        w, means[k] = WorkloadWindow(window_s=6, min_mix_arrivals=k), []
        for i, a in enumerate(arrivals):
            w.add(a)
            if i >= 20:
                means[k].append(w.forecast(a.t + 0.01, 1.0).input_len)
    assert min(means[1]) == 24 and max(means[1]) == 900  # all-chat, all-RAG: noise
    assert min(means[16]) > 200 and max(means[16]) < 750  # around the true 462
    # A shift is still followed: 16 RAG prompts after a chat phase read as RAG.
    w = WorkloadWindow(window_s=6, min_mix_arrivals=16)
    for t in range(40):
        w.add(Arrival(float(t), 24 if t < 24 else 900, 8))
    assert w.forecast(40.0, 1.0).input_len == 900


def test_window_rejects_a_bad_window() -> None:
    with pytest.raises(ValueError, match="window_s must be > 0"):
        WorkloadWindow(window_s=0)
