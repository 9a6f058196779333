"""Helpers for bench tests, including the one short real run against a live stack."""

from __future__ import annotations

from pdserve_bench.runner import RunResult, smoke_run


def check_smoke_run(base_url: str, num_requests: int = 4, max_tokens: int = 8) -> RunResult:
    """A few requests against ``base_url`` (e.g. what ``pdserve up`` prints): all must succeed
    with exactly ``max_tokens`` tokens each (``ignore_eos``) and sane timings."""
    run = smoke_run(base_url, num_requests, max_tokens=max_tokens)
    assert run.summary.num_errors == 0, [(r.error, r.detail) for r in run.results if r.error]
    assert len(run.results) == num_requests
    for r in run.results:
        assert r.tokens_out == max_tokens, r
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert len(r.itls_s) >= 1 and all(x >= 0 for x in r.itls_s)
    return run
