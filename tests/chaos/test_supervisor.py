"""kill -9 of ``pdserve up`` itself: its children die with it (parent-death signal), one that
cannot (stopped with SIGSTOP) is killed by the next ``pdserve up`` from the pidfile, and the
relaunch serves."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdserve import stackfile
from pdserve_bench.chaos import ChaosStack

ARGS = ["--model", "tiny", "--prefill", "1", "--decode", "1", "--kvd-capacity-mib", "16"]


def _alive(pids: dict[str, int]) -> dict[str, int]:
    return {n: p for n, p in pids.items() if stackfile.start_time(p) is not None
            and not _is_zombie(p)}


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_kill_9_of_pdserve_up_leaves_nothing_running_and_a_relaunch_works() -> None:
    first = ChaosStack(ARGS).start()
    try:
        children = first.children()
        assert set(children) >= {"redis", "kvd-p0", "prefill-0", "kvd-d0", "decode-0",
                                 "router", "gateway"}
        assert first.probe().ok
        os.kill(children["decode-0"], signal.SIGSTOP)  # cannot act on its parent's death
        assert first.proc is not None
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while set(_alive(children)) != {"decode-0"} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert set(_alive(children)) == {"decode-0"}  # the rest went with their parent
    except BaseException:
        for pid in children.values():
            os.kill(pid, signal.SIGKILL)
        raise
    with ChaosStack(ARGS) as second:
        assert "decode-0" not in _alive(children)
        stale = f"killed decode-0 (pid {children['decode-0']}), left running by a pdserve up"
        assert any(stale in line for line in second.lines), second.lines[:5]
        assert second.probe().ok
        relaunched = second.children()
    deadline = time.monotonic() + 15
    while _alive(relaunched) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(relaunched)
