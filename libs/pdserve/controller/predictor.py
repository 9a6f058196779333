"""Workload predictor: arrival rate and the input/output length mix over a sliding window, and a
short-horizon forecast with Holt's linear trend (double exponential smoothing).

Pure functions and one small window class; the controller feeds it one ``Arrival`` per request
the router admits (its prompt length, and its answer length when it finishes or its
``max_tokens`` as the estimate).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrival:
    t: float  # seconds, any monotonic clock
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Load:
    """The workload the optimizer plans for."""

    rate: float  # requests per second
    input_len: float  # mean prompt tokens
    output_len: float  # mean generated tokens
    # E[L_in²], the prompt length's second moment: a prefill queue's wait grows with it
    # (Pollaczek-Khinchine), and a mix of 24- and 900-token prompts has a far larger one than
    # its mean alone says. 0 = not known: taken as a constant mix (input_len²).
    input_len_sq: float = 0.0

    @property
    def input_len_2nd(self) -> float:
        """E[L_in²], never below input_len² (the variance cannot be negative)."""
        return max(self.input_len_sq, self.input_len ** 2)


def holt(series: Sequence[float], alpha: float, beta: float, horizon: float) -> float:
    """Holt's linear trend forecast ``horizon`` steps past the last value of ``series``.

    level_t = α·x_t + (1-α)(level + trend);  trend_t = β(level_t - level) + (1-β)·trend;
    forecast = level + horizon·trend, never below zero (rates and lengths are non-negative).
    """
    if not series:
        raise ValueError("holt: the series is empty")
    if not (0 < alpha <= 1 and 0 <= beta <= 1):
        raise ValueError(f"holt: alpha must be in (0, 1] and beta in [0, 1], got {alpha}, {beta}")
    level = series[0]
    trend = series[1] - series[0] if len(series) > 1 else 0.0
    for x in series[1:]:
        prev = level
        level = alpha * x + (1 - alpha) * (level + trend)
        trend = beta * (level - prev) + (1 - beta) * trend
    return max(0.0, level + horizon * trend)


def bucket_rates(times: Sequence[float], start: float, end: float, num_buckets: int) -> list[float]:
    """Arrivals per second in ``num_buckets`` equal buckets of [start, end)."""
    if end <= start or num_buckets < 1:
        raise ValueError(f"bucket_rates: need end > start and num_buckets >= 1, got "
                         f"[{start}, {end}) in {num_buckets}")
    width = (end - start) / num_buckets
    counts = [0] * num_buckets
    for t in times:
        if start <= t < end:
            counts[min(num_buckets - 1, int((t - start) / width))] += 1
    return [c / width for c in counts]


class WorkloadWindow:
    """The arrivals of the last ``window_s`` seconds and a forecast of the next interval."""

    def __init__(self, window_s: float, num_buckets: int = 6, alpha: float = 0.5,
                 beta: float = 0.3, min_mix_arrivals: int = 16) -> None:
        if window_s <= 0 or num_buckets < 1 or min_mix_arrivals < 1:
            raise ValueError("window_s must be > 0, num_buckets >= 1 and min_mix_arrivals >= 1")
        self.window_s = window_s
        self.num_buckets = num_buckets
        self.alpha, self.beta = alpha, beta
        self._arrivals: deque[Arrival] = deque()
        self._latest: deque[Arrival] = deque(maxlen=min_mix_arrivals)

    def add(self, arrival: Arrival) -> None:
        self._arrivals.append(arrival)
        self._latest.append(arrival)

    def _trim(self, now: float) -> None:
        while self._arrivals and self._arrivals[0].t < now - self.window_s:
            self._arrivals.popleft()

    def current(self, now: float) -> Load:
        """Mean rate and length mix over the window (lengths are token-weighted by count;
        with the prompt length's second moment)."""
        self._trim(now)
        arrivals = self._arrivals
        if not arrivals:
            return Load(0.0, 0.0, 0.0)
        return _load(len(arrivals) / self.window_s, arrivals)

    def forecast(self, now: float, horizon_s: float) -> Load:
        """The rate ``horizon_s`` ahead by Holt's trend over the window's buckets, never below
        the window's mean rate; the mix as the latest half of the window has it, or the last
        ``min_mix_arrivals`` requests when it has fewer (mix shifts are followed, not
        extrapolated), the prompt length's second moment included.

        The floor: at a steady 1 req/s in 1 s buckets most buckets hold 0, 1 or 2 arrivals,
        and the trend fitted to that noise took the forecast to 0 on ~15% of ticks (seen in
        the router's decision log), each a "no load" tick that reset the stabilization of a
        pending switch. A real fall still shows: the mean itself falls within one window,
        so planning capacity down lags by at most the window (up is not delayed at all)."""
        self._trim(now)
        if not self._arrivals:
            return Load(0.0, 0.0, 0.0)
        rates = bucket_rates([a.t for a in self._arrivals], now - self.window_s, now,
                             self.num_buckets)
        width = self.window_s / self.num_buckets
        rate = max(holt(rates, self.alpha, self.beta, horizon_s / width),
                   len(self._arrivals) / self.window_s)
        recent = [a for a in self._arrivals if a.t >= now - self.window_s / 2]
        if len(recent) < len(self._latest):
            # Too few to say the mix: at 1 req/s the latest 3 s hold 1-3 requests, and a mix
            # of 24- and 900-token prompts read from them swung between all-chat and all-RAG
            # tick by tick (seen: 28/93 -> 900/6 tokens a second apart on a steady mix), which
            # moved the engines back and forth. The last ``min_mix_arrivals`` instead (older
            # ones included): a shift is followed within that many requests.
            recent = list(self._latest)
        return _load(rate, recent)


def _load(rate: float, arrivals: Sequence[Arrival]) -> Load:
    """``rate`` with the mix of ``arrivals``: mean prompt and answer lengths and the prompt
    length's second moment, all over the same arrivals (the forecast scales none of them)."""
    n = len(arrivals)
    return Load(rate, sum(a.input_len for a in arrivals) / n,
                sum(a.output_len for a in arrivals) / n,
                sum(a.input_len ** 2 for a in arrivals) / n)
