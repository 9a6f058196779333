"""``pdserve bench faults``: a fault naming no child of the stack is refused before any stack
starts, with the names it could have been."""

from __future__ import annotations

import subprocess
import sys

from pdserve_bench.faults import children_of
from tests.e2e.stack import ROOT, child_env


def test_the_children_of_a_stack_by_name() -> None:
    assert children_of(1, 2) == ["redis", "kvd-p0", "prefill-0", "kvd-d0", "decode-0",
                                 "kvd-d1", "decode-1", "router", "gateway"]


def test_an_unknown_fault_is_named() -> None:
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "faults", "--faults",
                           "decode-0,decode-7"], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert ("--faults: no child 'decode-7' in a stack of 1 prefill + 2 decode nodes (it runs "
            "redis, kvd-p0, prefill-0") in proc.stderr
