"""``pdserve up``: its CPU-set syntax, its errors, and a dead service reported (not hidden)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.launcher import build_parser, parse_cpus
from tests.e2e.stack import ROOT, UpStack, child_env


def test_cpu_sets() -> None:
    assert parse_cpus("0;1") == [{0}, {1}]
    assert parse_cpus("0-1") == [{0, 1}]
    assert parse_cpus("0,2;1") == [{0, 2}, {1}]
    assert parse_cpus("") == []


def test_defaults_are_one_prefill_one_decode_on_loopback() -> None:
    ns = build_parser().parse_args([])
    assert (ns.prefill, ns.decode, ns.colocated, ns.host) == (1, 1, False, "127.0.0.1")


@pytest.mark.parametrize(("args", "needle"), [
    (["--prefill", "0"], "--prefill and --decode must be >= 1 (or use --colocated)"),
    (["--policy", "random"], "argument --policy: invalid choice: 'random'"),
])
def test_bad_arguments_exit_with_a_clear_message(args: list[str], needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", *args], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert needle in proc.stderr


def test_a_service_that_cannot_start_is_reported_with_its_log() -> None:
    up = UpStack(["--colocated", "--decode", "1", "--model", "/no/such/model/dir",
                  "--ready-timeout", "60"])
    with pytest.raises(RuntimeError) as err:
        up.start(timeout=90)
    output = str(err.value)
    assert "decode-0 did not become ready" in output
    assert "/no/such/model/dir" in output
