"""Per-request timings from stream events, and the run's summary (percentiles, goodput).

Timing model of one streamed request (all times from ``time.perf_counter``)::

    start ── first chunk with n1 >= 1 tokens ── chunk n2 ── chunk n3 ... ── end (stream done)
          |<-- TTFT -->|<---- dt2 ---->|<- dt3 ->|
    ITLs: a chunk carrying n tokens that arrived dt after the previous token-carrying chunk
          adds n ITLs of dt / n each (tokens batched into one chunk are spread evenly, so there
          is one ITL per generated token after the first chunk's);
    TPOT = (last token chunk - first token chunk) / (tokens_out - 1)   (None when tokens_out < 2),
           with tokens_out from the server's usage when it reports one (see client.py);
    E2E  = end - start.

Chunks with no new tokens (a role-only first chunk, a usage-only last chunk) are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default ``method="linear"``)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timings:
    ttft_s: float | None
    tpot_s: float | None
    itls_s: tuple[float, ...]
    num_tokens: int  # tokens counted from the chunks
    decode_s: float = 0.0  # first token-carrying chunk -> last one

    def tpot_for(self, tokens_out: int) -> float | None:
        """TPOT with the server's own token count (usage), which chunk counting can miss."""
        return self.decode_s / (tokens_out - 1) if tokens_out > 1 and self.ttft_s is not None \
            else None


def timings_from_events(start: float, events: Iterable[tuple[float, int]]) -> Timings:
    """``events``: (arrival time, new tokens) per stream chunk, in arrival order."""
    first: float | None = None
    prev: float | None = None
    last = start
    num_tokens = 0
    itls: list[float] = []
    for t, n in events:
        if n < 0:
            raise ValueError(f"a chunk cannot carry {n} tokens")
        if n == 0:
            continue
        if first is None:
            first = t
        else:
            assert prev is not None
            itls.extend([(t - prev) / n] * n)
        prev = last = t
        num_tokens += n
    if first is None:
        return Timings(None, None, (), 0)
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else None
    return Timings(first - start, tpot, tuple(itls), num_tokens, last - first)


@dataclass(frozen=True)
class RequestResult:
    """What one request measured. ``error`` is a short kind (``http_500``, ``timeout``...);
    ``detail`` says more. Failed requests keep what they measured but count only as errors."""

    conversation: int
    turn: int
    kind: str
    start_s: float  # offset from the run's start
    e2e_s: float
    ttft_s: float | None
    tpot_s: float | None
    itls_s: tuple[float, ...]
    tokens_in: int  # server's usage.prompt_tokens when reported, else the planned count
    tokens_out: int  # server's usage.completion_tokens when reported, else counted chunks
    cached_tokens: int | None = None
    error: str | None = None
    detail: str = ""

    @property
    def is_ok(self) -> bool:
        return self.error is None

    def meets(self, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
        """Goodput test. A request with one output token has no TPOT and cannot miss it."""
        if not self.is_ok or self.ttft_s is None:
            return False
        if slo_ttft_s is not None and self.ttft_s > slo_ttft_s:
            return False
        return slo_tpot_s is None or self.tpot_s is None or self.tpot_s <= slo_tpot_s

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["itls_s"] = list(self.itls_s)
        return out


@dataclass(frozen=True)
class Dist:
    """Distribution of one latency, in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Dist | None:
        if not values:
            return None
        ms = [v * 1000.0 for v in values]
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(len(ms), sum(ms) / len(ms), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    num_errors: int
    errors: dict[str, int]
    num_skipped: int  # multiturn turns never sent because an earlier turn failed
    duration_s: float
    throughput_rps: float
    output_tok_s: float
    goodput_rps: float | None  # None when no SLO was given
    slo_attainment: float | None  # share of ok+failed requests meeting both SLOs
    ttft: Dist | None
    tpot: Dist | None
    itl: Dist | None
    e2e: Dist | None
    tokens_in_mean: float
    tokens_out_mean: float
    extra: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def flat(self) -> dict[str, float | int | None]:
        """The report's per-configuration keys (``ttft_p50_ms``, ``itl_p99_ms``...)."""
        out: dict[str, float | int | None] = {}
        for name in ("ttft", "tpot", "itl", "e2e"):
            dist: Dist | None = getattr(self, name)
            for q in ("p50", "p90", "p99"):
                out[f"{name}_{q}_ms"] = None if dist is None else getattr(dist, q)
        out.update(throughput_rps=self.throughput_rps, output_tok_s=self.output_tok_s,
                   goodput_rps=self.goodput_rps, slo_attainment=self.slo_attainment,
                   errors=self.num_errors, num_requests=self.num_requests)
        out.update(self.extra)
        return out


def prefix_reuse(results: Sequence[RequestResult], block_size: int) -> dict[str, float]:
    """Later turns of multiturn conversations: the prompt tokens the server reported cached,
    next to the oracle, the previous turn's prompt + answer tokens that fall in full blocks
    (its answer's last token has no KV yet; the block of this prompt's last token is always
    computed). The oracle assumes this turn's prompt repeats the previous prompt and answer
    token for token, as a chat template does when the answer re-tokenizes alike."""
    by_turn = {(r.conversation, r.turn): r for r in results if r.is_ok}
    cached = oracle = num = 0
    for (conv, turn), r in by_turn.items():
        prev = by_turn.get((conv, turn - 1))
        if turn == 0 or prev is None or r.cached_tokens is None:
            continue
        had = prev.tokens_in + prev.tokens_out - 1
        oracle += min(had, r.tokens_in - 1) // block_size * block_size
        cached += r.cached_tokens
        num += 1
    if not num:
        return {}
    return {"later_turns": num, "later_turn_cached_tokens": cached,
            "later_turn_oracle_tokens": oracle,
            "cached_of_oracle": cached / oracle if oracle else 0.0}


def summarize(
    results: Sequence[RequestResult],
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    num_skipped: int = 0,
    block_size: int = 16,
) -> Summary:
    """Throughputs divide by the span from the first send to the last finish."""
    ok = [r for r in results if r.is_ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    span = 0.0
    if results:
        span = max(r.start_s + r.e2e_s for r in results) - min(r.start_s for r in results)
    per_s = (lambda n: n / span) if span > 0 else (lambda n: 0.0)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    ttft_s = None if slo_ttft_ms is None else slo_ttft_ms / 1000.0
    tpot_s = None if slo_tpot_ms is None else slo_tpot_ms / 1000.0
    num_good = sum(r.meets(ttft_s, tpot_s) for r in results)
    return Summary(
        num_requests=len(results),
        num_ok=len(ok),
        num_errors=len(results) - len(ok),
        errors=dict(sorted(errors.items())),
        num_skipped=num_skipped,
        duration_s=span,
        throughput_rps=per_s(len(ok)),
        output_tok_s=per_s(sum(r.tokens_out for r in ok)),
        goodput_rps=per_s(num_good) if has_slo else None,
        slo_attainment=(num_good / len(results)) if has_slo and results else None,
        ttft=Dist.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Dist.of_seconds([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=Dist.of_seconds([x for r in ok for x in r.itls_s]),
        e2e=Dist.of_seconds([r.e2e_s for r in ok]),
        tokens_in_mean=sum(r.tokens_in for r in ok) / len(ok) if ok else 0.0,
        tokens_out_mean=sum(r.tokens_out for r in ok) / len(ok) if ok else 0.0,
        extra=prefix_reuse(results, block_size),
    )


def format_table(summary: Summary, title: str = "") -> str:
    """A human table: one row per latency, then the rates."""
    lines = [title] if title else []
    lines.append(f"{'metric (ms)':<12}{'mean':>10}{'P50':>10}{'P90':>10}{'P99':>10}{'n':>8}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        d: Dist | None = getattr(summary, name)
        if d is None:
            lines.append(f"{name.upper():<12}{'-':>10}{'-':>10}{'-':>10}{'-':>10}{0:>8}")
        else:
            lines.append(f"{name.upper():<12}{d.mean:>10.1f}{d.p50:>10.1f}{d.p90:>10.1f}"
                         f"{d.p99:>10.1f}{d.count:>8}")
    goodput = "-" if summary.goodput_rps is None else f"{summary.goodput_rps:.3f} req/s"
    errors = ", ".join(f"{k}={v}" for k, v in summary.errors.items()) or "none"
    lines += [
        f"requests {summary.num_ok}/{summary.num_requests} ok in {summary.duration_s:.2f} s"
        + (f", {summary.num_skipped} turns skipped" if summary.num_skipped else ""),
        f"throughput {summary.throughput_rps:.3f} req/s, {summary.output_tok_s:.1f} output tok/s",
        f"goodput {goodput}   errors {summary.num_errors} ({errors})",
    ]
    if "later_turns" in summary.extra:
        x = summary.extra
        lines.append(f"later turns {x['later_turns']:.0f}: cached "
                     f"{x['later_turn_cached_tokens']:.0f} of an oracle "
                     f"{x['later_turn_oracle_tokens']:.0f} prompt tokens "
                     f"({100 * x['cached_of_oracle']:.1f}%)")
    return "\n".join(lines)
