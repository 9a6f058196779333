"""Pidfiles of running ``pdserve up`` stacks, so a stack whose supervisor was killed leaves
nothing running behind it.

Each supervisor keeps ``<run dir>/<its pid>.json``: its own pid and start time, and those of
every child it started (rewritten at each start and restart, removed at a clean stop)::

    {"pid": 4100, "start": 81234, "children": [{"name": "kvd-p0", "pid": 4107, "start": 81240}]}

Children die with their supervisor (PR_SET_PDEATHSIG) — unless one cannot: a stopped
(SIGSTOP) process keeps its SIGTERM pending, one stuck in shutdown ignores it. So a starting
supervisor first reads every pidfile whose supervisor is gone and SIGKILLs the process group of
each child still alive: a pid counts as the child only while its start time (``/proc/<pid>/stat``)
is the one recorded, so a reused pid is never killed. Live stacks' files are left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path


def run_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"pdserve-up-{os.getuid()}"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None
    if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # fields after "(comm)" start at 3


@dataclass(frozen=True)
class Entry:
    name: str
    pid: int
    start: int

    def is_alive(self) -> bool:
        return start_time(self.pid) == self.start


def entry(name: str, pid: int) -> Entry | None:
    start = start_time(pid)
    return None if start is None else Entry(name, pid, start)


class StackFile:
    """This supervisor's pidfile."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or run_dir()
        self.path = self.directory / f"{os.getpid()}.json"

    def write(self, children: Iterable[Entry]) -> None:
        me = entry("pdserve up", os.getpid())
        assert me is not None
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = {"pid": me.pid, "start": me.start, "children": [asdict(c) for c in children]}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def clean_stale(directory: Path | None = None) -> list[Entry]:
    """SIGKILL what stacks with a dead supervisor left running; remove their pidfiles.
    Returns the children killed."""
    directory = directory or run_dir()
    killed: list[Entry] = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            owner = Entry("pdserve up", int(data["pid"]), int(data["start"]))
            children = [Entry(**c) for c in data["children"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours: left alone
        if owner.is_alive():
            continue
        for child in children:
            if child.is_alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGKILL)  # its own group: grandchildren too
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child.pid, signal.SIGKILL)
                killed.append(child)
        path.unlink(missing_ok=True)
    return killed
