"""A receiving kvd faults a peer's pool in once, in the background, when it first maps it
(services/kvd/samehost.py): its transfers then copy from mapped pages, and its event loop
never waits for the mapping. In-process, on a real segment in /dev/shm."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import numpy as np

from pdserve.kvd import layout as L
from services.kvd import samehost, segments

SLOT = 64 * 1024
SLOTS = 512  # 32 MiB


def _resident_kib(path: str) -> int:
    """Resident KiB of this process's read-only mappings of ``path`` (/proc/self/smaps): the
    receiver's, not the owner's read-write one (the same process here)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and ":" not in fields[0]:  # a mapping's header line
            inside = line.rstrip().endswith(path) and fields[1] == "r--s"
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_peer_pool_is_faulted_in_once_in_the_background() -> None:
    name = segments.segment_name("prefault-test", os.getpid(), int(time.time() * 1000))
    shm = segments.create(name, L.segment_bytes(SLOT, SLOTS))
    try:
        assert shm.buf is not None
        token = secrets.token_bytes(L.TOKEN_BYTES)
        L.write_header(shm.buf, SLOT, SLOTS, 1, token)
        np.ndarray((shm.size,), np.uint8, shm.buf)[L.HEADER_BYTES::4096] = 1  # the pool exists
        own = np.zeros(L.segment_bytes(SLOT, 4), np.uint8)
        mapper = samehost.SameHost(own, L.HEADER_BYTES, SLOT, shm_dir=segments.SHM_DIR)
        path = str(segments.SHM_DIR / name)
        started = time.monotonic()
        peer = mapper.open(name, token)
        assert peer is not None and time.monotonic() - started < 0.5  # not populated inline
        deadline = time.monotonic() + 10
        while _resident_kib(path) < shm.size // 1024 * 0.99:
            assert time.monotonic() < deadline, f"only {_resident_kib(path)} KiB resident"
            time.sleep(0.02)
        assert mapper.open(name, token) is peer  # mapped (and faulted) once per peer
        mapper.close()
    finally:
        segments.remove(shm)
