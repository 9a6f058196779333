"""The pidfile check of ``pdserve up``: what a dead supervisor left running is killed (its
whole process group), a live supervisor's children and a reused pid are left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdserve import stackfile

# A child that survives its supervisor: it ignores SIGTERM (a parent-death signal) and SIGHUP.
_STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "signal.signal(signal.SIGHUP, signal.SIG_IGN); print('up', flush=True); "
             "time.sleep(120)")


def _stubborn() -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE,
                            text=True, process_group=0)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def _write(directory: Path, owner: stackfile.Entry, children: list[stackfile.Entry]) -> Path:
    path = directory / f"{owner.pid}.json"
    path.write_text(json.dumps({"pid": owner.pid, "start": owner.start,
                                "children": [c.__dict__ for c in children]}))
    return path


def test_a_dead_supervisors_children_are_killed_and_its_file_removed(tmp_path: Path) -> None:
    child = _stubborn()
    try:
        entry = stackfile.entry("decode-0", child.pid)
        assert entry is not None
        path = _write(tmp_path, stackfile.Entry("pdserve up", _dead_pid(), 1), [entry])
        assert stackfile.clean_stale(tmp_path) == [entry]
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert not path.exists()
    finally:
        child.kill()


def test_a_live_supervisor_and_a_reused_pid_are_left_alone(tmp_path: Path) -> None:
    child = _stubborn()
    try:
        entry = stackfile.entry("router", child.pid)
        me = stackfile.entry("pdserve up", os.getpid())
        assert entry is not None and me is not None
        live = _write(tmp_path, me, [entry])
        reused = stackfile.Entry("router", child.pid, entry.start + 1)  # another process's
        dead = _write(tmp_path, stackfile.Entry("pdserve up", _dead_pid(), 1), [reused])
        assert stackfile.clean_stale(tmp_path) == []
        time.sleep(0.2)
        assert child.poll() is None
        assert live.exists() and not dead.exists()
    finally:
        child.kill()


def test_the_supervisors_own_file_lists_its_children(tmp_path: Path) -> None:
    child = _stubborn()
    try:
        f = stackfile.StackFile(tmp_path)
        entry = stackfile.entry("kvd-p0", child.pid)
        assert entry is not None
        f.write([entry])
        data = json.loads(f.path.read_text())
        assert data["pid"] == os.getpid()
        assert data["children"] == [{"name": "kvd-p0", "pid": child.pid, "start": entry.start}]
        f.remove()
        assert not f.path.exists()
    finally:
        child.kill()
