"""``pdserve bench router`` runs end to end (tiny sizes; the numbers are not judged here)."""

from __future__ import annotations

import json

import pytest

from pdserve_bench import router as bench


def test_bench_router_runs_and_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = bench.main(["--json", "--requests", "5", "--warmup", "1", "--seconds", "0.2",
                       "--concurrency", "2", "--no-gateway"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["paths"]) == {"direct", "bare grpc relay", "router"}
    assert result["router_rps"] > 0 and result["paths"]["router"]["median_ms"] > 0
    assert set(result["concurrent"]) == {"direct", "router"}
    assert result["concurrent"]["router"]["rps"] == result["router_rps"]
    assert [t["path"] for t in result["targets"]] == ["router"]
    assert "added median" in out


def test_bench_router_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--requests", "0"])
    assert "--requests: must be >= 1" in capsys.readouterr().err
