"""``pdserve bench transfer``: its default mode moves blocks between two real kvds (which must
accept each other as peers since push destinations are authenticated), and prints a row per
batch, then one block through two real engines' kvd bridges; a batch below 1 MiB is refused
naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.stack import ROOT, child_env


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "transfer", *args],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)


def test_the_default_mode_moves_a_batch_between_two_kvds() -> None:
    proc = _bench("--sizes", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rows = [r for r in lines if "bench" not in r]
    assert [r["batch_bytes"] for r in rows] == [1 << 20]
    assert rows[0]["kvd_gbps"] > 0 and rows[0]["e2e_gbps"] > 0 and rows[0]["grpc_gbps"] > 0
    assert rows[0]["e2e_stream_gbps"] > 0 and rows[0]["e2e_ucx_gbps"] > 0
    # the engines' calls went the way each column says
    assert (rows[0]["control"], rows[0]["control_stream"]) == ("socket", "stream")
    # then one block through two real engines' bridges (the tiny model's 32 KiB block)
    (engines,) = [r for r in lines if r.get("bench") == "transfer_engines"]
    assert engines["model"] == "tiny" and engines["engines_block_bytes"] == 32 * 1024
    assert engines["engines_reps"] == 100
    assert 0 < engines["engines_export_ms"] < engines["engines_block_ms"]
    assert 0 < engines["engines_receive_ms"] < engines["engines_block_ms"]
    assert "engines: one 32 KiB block of the tiny model" in proc.stdout


def test_a_batch_below_one_mib_is_refused() -> None:
    proc = _bench("--sizes", "0")
    assert proc.returncode == 2
    assert "--sizes: every batch is at least 1 MiB, got 0" in proc.stderr
