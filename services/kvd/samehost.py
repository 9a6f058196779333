"""Same-host pushes: the receiving kvd maps the sending kvd's pool and copies the blocks straight
from its slots into its own (one copy, no UCX, no bounce buffer).

    sender A (Commit with push)                    receiver B (same host)
    blocks written, NOT yet checked or
    published (the writer's pins hold
    them); Transfer(PUSH, shm_name,     ──gRPC──►  map /dev/shm/<shm_name> read-only (cached)
      shm_token, same_host_only)                    and check magic, slot size and token;
                                                    per run of blocks, in worker threads: copy
                                                    A's slots into B's, xxh3 each block while it
                                                    is in cache, compare with the writer's;
                                                    copy the mismatched ones once more;
                                                    A still alive? publish the good blocks,
                                                    fail the others (DATA_LOSS)
    blocks B checked need no pass here;  ◄───────  same_host: true, checksums as copied
    check the rest, publish, answer

B's check of its copy stands for A's own pass over the blocks: the copy is of A's slot while
the writer's pins hold it. A block B did not take (it held it already, or its copy mismatched)
A checks itself; a mismatch there fails the Commit (INVALID_ARGUMENT) and nothing is published
on A. A receiver that cannot map the segment (another host) accepts nothing; A then checks,
publishes and pushes over UCX, and remembers that peer as "elsewhere".

Why a dead peer cannot crash the reader: a mapping of a POSIX shared-memory file stays valid
after its creator dies and after the file is unlinked (the pages live until the last mapping
goes); only shrinking the file would fault its readers, and no kvd ever truncates a pool. So
the copy always finishes; the receiver then checks that the creator (its pid is in the
segment name, ``segments.segment_name``) is still alive, and fails the transfer closed
(ABORTED, its slots freed) when it is not: a dead sender's pins no longer stand for its slots.
A replaced peer has another segment name (pid and epoch) and another random token; a cached
mapping whose creator died is dropped. A segment that cannot be mapped, or holds another
token (another host's pool of the same name), or whose creator this kvd cannot see (another
pid namespace), means "not this host": the push goes over UCX.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.hashing import block_checksum
from pdserve.kvd import layout as L
from pdserve.procs import pid_alive
from services.kvd import segments
from services.kvd.config import KvdConfig

log = logging.getLogger(__name__)

# Below this many bytes a copy runs on the event loop: a thread hop costs more than it saves.
INLINE_COPY_BYTES = 4 << 20


@dataclass(frozen=True)
class SameHostFaults:
    """TEST HOOKS ONLY (--fault-same-host-* flags). corrupt_every: flip one byte of every Nth
    block copied here (after the copy, before its checksum). delay_ms: sleep between the copy
    and the check that the peer is still alive."""

    corrupt_every: int = 0
    delay_ms: int = 0


@dataclass
class PeerPool:
    """A peer kvd's pool segment, mapped read-only."""

    name: str
    pid: int | None
    token: bytes
    slot_bytes: int
    num_slots: int
    arr: np.ndarray

    def alive(self) -> bool:
        """Whether the kvd that created the segment still runs."""
        return self.pid is not None and pid_alive(self.pid)


def map_segment(name: str, shm_dir: Path = segments.SHM_DIR) -> PeerPool | None:
    """Map a kvd pool segment of this host read-only; None if there is none of that name or it
    is not a whole kvd pool."""
    if "/" in name or not name.startswith(segments.PREFIX):
        return None
    try:
        fd = os.open(shm_dir / name, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < L.HEADER_BYTES:
            return None
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)
    try:
        slot_bytes, num_slots, _ = L.read_header(arr.data)
    except ValueError:
        return None
    if size < L.segment_bytes(slot_bytes, num_slots):
        return None
    return PeerPool(name, segments.owner_pid(name), L.read_token(arr.data), slot_bytes,
                    num_slots, arr)


def prefault(arr: np.ndarray) -> None:
    """Read one byte of every page of a mapping (numpy's reduction releases the GIL)."""
    arr[::mmap.PAGESIZE].max()


class SameHost:
    """Peer pools this kvd has mapped, and the copy from one of them into its own pool."""

    def __init__(self, own: np.ndarray, data_offset: int, slot_bytes: int,
                 faults: SameHostFaults = SameHostFaults(),
                 shm_dir: Path = segments.SHM_DIR, threads: int = 2) -> None:
        self._own = own
        self._data_offset = data_offset
        self.slot_bytes = slot_bytes
        self.faults = faults
        self._dir = shm_dir
        self._maps: dict[str, PeerPool] = {}
        self._num_copied = 0
        self._fault_lock = threading.Lock()
        self._threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvd-copy")

    def open(self, name: str, token: bytes) -> PeerPool | None:
        """The peer pool ``name`` if it is on this host and holds ``token``; else None."""
        for stale in [n for n, p in self._maps.items() if not p.alive()]:
            del self._maps[stale]  # its pages go with the last view of them
        if not name or len(token) != L.TOKEN_BYTES or not any(token):
            return None
        peer = self._maps.get(name)
        if peer is None:
            peer = map_segment(name, self._dir)
            if peer is None:
                return None
            self._maps[name] = peer
            log.info("peer pool mapped (same host)", extra={"fields": {"shm": name}})
            # Fault its pages in once, in the background: on first touch each fresh slot's
            # copy paid ~0.25 µs a page (~0.1 ms a MiB) inside a transfer. Not MAP_POPULATE:
            # mmap() holds the GIL, and a large pool would stall the event loop for seconds.
            threading.Thread(target=prefault, args=(peer.arr,), name="kvd-prefault",
                             daemon=True).start()
        if peer.token != token or peer.slot_bytes != self.slot_bytes or not peer.alive():
            return None  # a creator this kvd cannot see (another pid namespace): not this host
        return peer

    async def copy(self, peer: PeerPool, src: list[int], dst: list[int]) -> list[int]:
        """Copy the peer's slots ``src`` into this pool's ``dst``; the xxh3 of each copied
        block, taken right after its copy (still in cache). Small copies run inline (a thread
        hop costs more); larger ones are cut into ``threads`` runs copied at once in worker
        threads (numpy's copy and xxhash release the GIL: one core alone does not reach the
        memory bandwidth)."""
        for s in src:
            if not 0 <= s < peer.num_slots:
                raise ValueError(f"slots: peer slot {s} out of range 0..{peer.num_slots - 1}")
        if len(src) * self.slot_bytes < INLINE_COPY_BYTES:
            return self._copy_run(peer, src, dst)
        step = -(-len(src) // self._threads)
        loop = asyncio.get_running_loop()
        runs = await asyncio.gather(*[
            loop.run_in_executor(self._executor, self._copy_run, peer, src[i:i + step],
                                 dst[i:i + step]) for i in range(0, len(src), step)])
        return [c for run in runs for c in run]

    def close(self) -> None:
        self._executor.shutdown(wait=False)

    def _copy_run(self, peer: PeerPool, src: list[int], dst: list[int]) -> list[int]:
        sb = self.slot_bytes
        sums = []
        for s, d in zip(src, dst, strict=True):
            at = self._data_offset + d * sb
            out = self._own[at:at + sb]
            frm = L.HEADER_BYTES + s * sb
            np.copyto(out, peer.arr[frm:frm + sb])
            n = self.faults.corrupt_every
            if n > 0:
                with self._fault_lock:
                    self._num_copied += 1
                    if self._num_copied % n == 0:
                        out[0] ^= 0xFF  # test hook: corrupt the copy, never the peer's pool
            sums.append(block_checksum(out.data))
        return sums


def make(config: KvdConfig, own: np.ndarray, slot_bytes: int, shm_name: str, token: bytes
         ) -> tuple[SameHost | None, tuple[str, bytes]]:
    """A kvd's same-host part: the mapper of peer pools, and its own pool's segment as offered
    to receivers (neither with ``--same-host false``, or when ``--ucx-tls`` keeps UCX off
    shared memory: such a kvd stands for, or sits on, a host of its own, e.g. in the network
    namespaces of ``pdserve_bench.cluster``). The UCX fault hooks exercise the UCX path, so a
    kvd under them offers no same-host copy."""
    if not config.same_host or not shares_memory(config.ucx_tls):
        return None, ("", b"")
    faults = SameHostFaults(config.fault_same_host_corrupt_every,
                            config.fault_same_host_delay_ms)
    mapper = SameHost(own, L.HEADER_BYTES, slot_bytes, faults, threads=config.copy_threads)
    if config.fault_corrupt_every or config.fault_send_delay_ms:
        return mapper, ("", b"")
    return mapper, (shm_name, token)


_SHM_TLS = {"all", "sm", "shm", "posix", "sysv"}


def shares_memory(ucx_tls: str) -> bool:
    """Whether a UCX_TLS setting lets UCX use shared memory ("" = UCX's default: yes;
    "^sm" or "tcp": no)."""
    names = {t.strip() for t in ucx_tls.lstrip("^").split(",") if t.strip()}
    if not ucx_tls.strip():
        return True
    if ucx_tls.startswith("^"):
        return not names & (_SHM_TLS - {"all"})
    return bool(names & _SHM_TLS)
