"""Names of kvd pool segments, and removal of the ones a dead kvd left behind.

A kvd killed with SIGKILL never unlinks its POSIX shared-memory pool, so each restart would
leave one more pool-sized file in ``/dev/shm``. Every segment's name carries the pid of the
kvd that created it::

    pdserve-kvd-<node id, sanitised>-<pid>-<epoch>

and a starting kvd unlinks exactly those whose creator is no longer alive. Segments of live
kvds are never touched, whatever their node id: several stacks on one host (tests run many)
may use the same node ids.

The pool is kept out of Python's resource tracker: the tracker outlives a SIGKILLed kvd and
unlinks its segments some moments later, racing the sweep above; one owner (the kvd, or the
next kvd's sweep) is simpler to reason about and to test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

from pdserve.procs import pid_alive

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kvd-"
_NAME = re.compile(rf"^{PREFIX}.*-(\d+)-(\d+)$")


def segment_name(node_id: str, pid: int, epoch: int) -> str:
    safe = "".join(c if c.isalnum() else "-" for c in node_id)[:40]
    return f"{PREFIX}{safe}-{pid}-{epoch}"


def create(name: str, size: int) -> shared_memory.SharedMemory:
    """A new segment that only ``remove`` (or a later kvd's ``unlink_stale``) unlinks."""
    shm = shared_memory.SharedMemory(name, create=True, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def remove(shm: shared_memory.SharedMemory, shm_dir: Path = SHM_DIR) -> None:
    """Close and unlink a segment made by ``create`` (untracked, so not ``shm.unlink()``)."""
    with contextlib.suppress(FileNotFoundError):
        (shm_dir / shm.name).unlink()
    shm.close()


def owner_pid(name: str) -> int | None:
    """The pid in a segment's name, or None for a name not made by ``segment_name``."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def unlink_stale(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments whose creating kvd is dead; return their names."""
    removed: list[str] = []
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return removed  # no /dev/shm here (not Linux): nothing to clean
    for path in entries:
        pid = owner_pid(path.name)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        try:
            path.unlink()
        except OSError:
            continue  # another kvd removed it first, or not ours to remove
        removed.append(path.name)
    if removed:
        log.info("removed pool segments of dead kvds", extra={"fields": {"segments": removed}})
    return removed
