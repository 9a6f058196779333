"""Statistics on synthetic timings: percentiles, ITL/TPOT extraction, goodput, chunk parsing."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve_bench.client import parse_chunk
from pdserve_bench.stats import (
    RequestResult,
    format_table,
    percentile,
    summarize,
    timings_from_events,
)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n: int) -> None:
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)


def test_ttft_tpot_itl_from_synthetic_stream() -> None:
    # role-only chunk, three token chunks (the last carries 2 tokens), usage-only chunk
    events = [(10.05, 0), (10.1, 1), (10.15, 1), (10.35, 2), (10.4, 0)]
    t = timings_from_events(10.0, events)
    assert t.ttft_s == pytest.approx(0.1)
    assert t.num_tokens == 4
    assert t.itls_s == pytest.approx((0.05, 0.1, 0.1))  # the 0.2 s gap spread over 2 tokens
    assert t.tpot_s == pytest.approx((10.35 - 10.1) / 3)
    assert t.tpot_s is not None and sum(t.itls_s) == pytest.approx(t.tpot_s * 3)


def test_timings_edge_cases() -> None:
    assert timings_from_events(0.0, [(1.0, 0)]).ttft_s is None
    one = timings_from_events(0.0, [(0.5, 1)])
    assert (one.ttft_s, one.tpot_s, one.itls_s) == (0.5, None, ())
    with pytest.raises(ValueError, match="cannot carry -1 tokens"):
        timings_from_events(0.0, [(0.5, -1)])


def _result(start: float, ttft: float | None, tpot: float | None, e2e: float,
            error: str | None = None, tokens_out: int = 10) -> RequestResult:
    return RequestResult(conversation=0, turn=0, kind="chat", start_s=start, e2e_s=e2e,
                         ttft_s=ttft, tpot_s=tpot, itls_s=(0.01,) * (tokens_out - 1),
                         tokens_in=5, tokens_out=tokens_out, error=error)


def test_goodput_counts_requests_meeting_both_slos() -> None:
    results = [
        _result(0.0, 0.1, 0.02, 1.0),   # meets both
        _result(1.0, 0.5, 0.02, 2.0),   # misses TTFT
        _result(2.0, 0.1, 0.09, 2.0),   # misses TPOT
        _result(3.0, 0.2, None, 1.0, tokens_out=1),  # one token: no TPOT to miss
        _result(3.5, None, None, 0.5, error="http_500"),
    ]
    s = summarize(results, slo_ttft_ms=200, slo_tpot_ms=50)
    assert s.duration_s == pytest.approx(4.0)  # first start 0 -> last end 4
    assert s.goodput_rps == pytest.approx(2 / 4.0)
    assert s.slo_attainment == pytest.approx(2 / 5)
    assert s.throughput_rps == pytest.approx(4 / 4.0)
    assert s.num_errors == 1 and s.errors == {"http_500": 1}
    assert s.output_tok_s == pytest.approx(31 / 4.0)
    assert s.ttft is not None and s.ttft.p50 == pytest.approx(150.0)
    assert s.tpot is not None and s.tpot.count == 3
    flat = s.flat()
    assert flat["ttft_p50_ms"] == pytest.approx(150.0) and flat["errors"] == 1
    assert summarize(results).goodput_rps is None  # no SLO, no goodput
    table = format_table(s, "t")
    assert "TTFT" in table and "goodput 0.500 req/s" in table and "http_500=1" in table


def test_summarize_of_nothing_and_only_errors() -> None:
    empty = summarize([])
    assert empty.num_requests == 0 and empty.ttft is None and empty.throughput_rps == 0.0
    failed = summarize([_result(0.0, None, None, 1.0, error="timeout")], slo_ttft_ms=100)
    assert failed.goodput_rps == 0.0 and failed.ttft is None and "TTFT" in format_table(failed)


def test_parse_chunk_token_counting_rules() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert parse_chunk(role, "chat", None) == (0, "", False)
    text = {"choices": [{"index": 0, "delta": {"content": " hi"}, "finish_reason": None}]}
    assert parse_chunk(text, "chat", None) == (1, " hi", False)
    ids = {"choices": [{"index": 0, "text": "abc", "token_ids": [1, 2, 3],
                        "finish_reason": "length"}]}
    assert parse_chunk(ids, "completions", None) == (3, "abc", True)
    # continuous usage: cumulative completion_tokens 7 after 4 -> 3 new tokens
    cont = {"choices": [{"index": 0, "text": "abc"}], "usage": {"completion_tokens": 7}}
    assert parse_chunk(cont, "completions", 4) == (3, "abc", False)
    final_usage = {"choices": [], "usage": {"completion_tokens": 7, "prompt_tokens": 3}}
    assert parse_chunk(final_usage, "completions", 7)[0] == 0


def test_prefix_reuse_of_later_turns_against_the_oracle() -> None:
    def turn(conv: int, index: int, tokens_in: int, tokens_out: int, cached: int | None,
             error: str | None = None) -> RequestResult:
        return RequestResult(conversation=conv, turn=index, kind="multiturn", start_s=0.0,
                             e2e_s=1.0, ttft_s=0.1, tpot_s=0.01, itls_s=(), tokens_in=tokens_in,
                             tokens_out=tokens_out, cached_tokens=cached, error=error)

    results = [
        turn(0, 0, 83, 40, 0),    # first turns are not counted
        turn(0, 1, 140, 20, 112),  # oracle: min(83 + 40 - 1, 139) // 16 * 16 = 112
        turn(0, 2, 180, 10, 144),  # oracle: min(140 + 20 - 1, 179) // 16 * 16 = 144
        turn(1, 0, 20, 5, 0),
        turn(1, 1, 30, 5, None, error="timeout"),  # failed: not counted
    ]
    s = summarize(results, block_size=16)
    assert s.extra == {"later_turns": 2, "later_turn_cached_tokens": 256,
                       "later_turn_oracle_tokens": 256, "cached_of_oracle": 1.0}
    assert "later turns 2: cached 256 of an oracle 256 prompt tokens (100.0%)" in format_table(s)
    assert summarize(results[:1]).extra == {}  # nothing multiturn: no reuse line


def test_bench_detok_runs_and_prints_json() -> None:
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "detok", "--lengths",
                           "10", "40", "--repeats", "1", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["num_tokens"] for r in rows] == [10, 40]
    assert all(r["incremental_us_per_token"] > 0 and r["redecode_us_per_token"] > 0
               for r in rows)
