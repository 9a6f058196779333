"""kill -9 of ``pdserve up`` itself: its children die with it (parent-death signal; a stopped
one too, once the kernel continues its orphaned process group), and the relaunch serves.
tests/launcher/test_stackfile.py covers a child that survives anyway."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdserve import stackfile
from pdserve_bench.chaos import ChaosStack
from tests.conftest import is_running

ARGS = ["--model", "tiny", "--prefill", "1", "--decode", "1", "--kvd-capacity-mib", "16"]


def _alive(pids: dict[str, int]) -> dict[str, int]:
    return {n: p for n, p in pids.items() if is_running(p)}


@pytest.mark.slow
def test_kill_9_of_pdserve_up_leaves_nothing_running_and_a_relaunch_works() -> None:
    first = ChaosStack(ARGS).start()
    children = first.children()
    try:
        assert set(children) >= {"redis", "kvd-p0", "prefill-0", "kvd-d0", "decode-0",
                                 "router", "gateway"}
        assert first.probe().ok
        # A stopped child cannot act on its parent-death signal until it runs again: its
        # process group, orphaned, gets SIGHUP and SIGCONT from the kernel.
        os.kill(children["decode-0"], signal.SIGSTOP)
        assert first.proc is not None
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(children)
    finally:
        for pid in _alive(children).values():
            os.kill(pid, signal.SIGKILL)
    pidfile = stackfile.run_dir() / f"{first.proc.pid}.json"
    with ChaosStack(ARGS) as second:
        assert not pidfile.exists()  # the dead stack's pidfile went with the relaunch's check
        assert second.probe().ok
        relaunched = second.children()
    deadline = time.monotonic() + 15
    while _alive(relaunched) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(relaunched)


def test_a_child_that_ran_long_is_respawned_at_once_and_a_crash_loop_backs_off(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pdserve.procs import Proc
    from services.launcher import STABLE_S, Stack, build_parser

    stack = Stack(build_parser().parse_args(["--log-dir", str(tmp_path)]))
    proc = Proc("prefill-0", [], 0)
    stack.started_at[proc.name] = time.monotonic() - STABLE_S - 1  # up a while, then killed
    assert stack._backoff(proc) == 0.0
    stack.started_at[proc.name] = time.monotonic()  # respawned, dies at once, again and again
    assert [stack._backoff(proc) for _ in range(3)] == [0.5, 1.0, 1.5]
    stack.started_at[proc.name] = time.monotonic() - STABLE_S - 1  # stable again: at once
    assert stack._backoff(proc) == 0.0


def test_a_restart_takes_over_the_warm_spare_and_rebinds_the_port() -> None:
    """A real kvd as the service: its spare (imports done, waiting) becomes the restarted
    process, same flags, same port; a spare that died first leaves a fresh start."""
    from services.launcher import Stack, _args, build_parser
    from services.supervisor_spare import WarmProc

    stack = Stack(_args(build_parser().parse_args(["--kvd-capacity-mib", "8", "--port", "0"])))
    stack.redis_url = ""
    stack.plan()
    kvd = next(p for p in stack.procs if p.name == "kvd-p0")
    warm = WarmProc(kvd.name, kvd.args, kvd.port, kvd.cpus, kvd.env, cwd=kvd.cwd)
    try:
        stack._start_one(warm)
        bound = warm.port
        warm.start_spare(warm.env)
        assert warm.spare is not None
        spare_pid = warm.spare.pid
        warm.stop()  # died
        warm.start(warm.env)
        assert warm.popen is not None and warm.popen.pid == spare_pid and warm.spare is None
        assert warm.wait_ready(60) == bound  # serving, on its port
        warm.start_spare(warm.env)
        assert warm.spare is not None
        warm.spare.kill()
        warm.spare.wait()
        warm.stop()
        warm.start(warm.env)  # no live spare: a fresh process
        assert warm.popen is not None and "services.supervisor_spare" not in warm.popen.args
        assert warm.wait_ready(60) == bound
    finally:
        warm.stop_spare()
        warm.stop()
        stack.pidfile.remove()
