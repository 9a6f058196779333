"""Same-host pushes (services/kvd/samehost.py): the receiving kvd copies from the sender's mapped
pool. Real kvd processes; the mapping itself against a real segment of a killed process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid

import grpc
import numpy as np
import pytest

from pdserve.hashing import block_checksum
from pdserve.kvd import layout as L
from services.kvd import segments
from services.kvd.config import KvdConfig
from services.kvd.samehost import (
    INLINE_COPY_BYTES,
    PeerPool,
    SameHost,
    make,
    map_segment,
    shares_memory,
)
from tests.kvd.conftest import ROOT
from tests.kvd.test_kvd_processes import (
    Factory,
    bytes_of,
    client,
    endpoint,
    entries,
    eventually,
    refs,
    start,
    write,
)


async def test_a_push_on_one_host_is_copied_from_the_peers_pool_bit_exact(
        kvd_factory: Factory, redis_url: str) -> None:
    a, b = start(kvd_factory, redis_url), start(kvd_factory, redis_url)
    ucx = start(kvd_factory, redis_url, "--same-host", "false")
    ca, cb, cu = await client(a), await client(b), await client(ucx)
    for dest, cdest in ((b, cb), (ucx, cu)):
        pins, hashes, sums = await write(ca, 9)
        want = bytes_of(ca, pins)
        r = await ca.commit(entries(pins, hashes, sums),
                            destination=endpoint(dest))
        assert (r.num_pushed, r.push_started) == (9, True)
        got = await cdest.await_blocks(refs(hashes, sums), timeout=10)
        assert bytes_of(cdest, got) == want
        await cdest.release([p.pin_id for p in got])
    sa, sb, su = await ca.stats(), await cb.stats(), await cu.stats()
    assert (sa.num_same_host, sa.num_transfers, sa.bytes_out) == (1, 2, 18 * 4096)
    assert (sb.num_same_host, sb.num_transfers, sb.bytes_in) == (1, 1, 9 * 4096)
    assert (su.num_same_host, su.num_transfers, su.bytes_in) == (0, 1, 9 * 4096)
    assert sa.slots_pinned == sb.slots_pinned == su.slots_pinned == 0
    for c in (ca, cb, cu):
        await c.close()


async def test_a_corrupted_same_host_copy_is_detected_and_copied_again(
        kvd_factory: Factory, redis_url: str) -> None:
    a = start(kvd_factory, redis_url)
    b = start(kvd_factory, redis_url, "--fault-same-host-corrupt-every", "5")
    ca, cb = await client(a), await client(b)
    pins, hashes, sums = await write(ca, 7)  # copy 5 is corrupted here; its second copy is 8
    want = bytes_of(ca, pins)
    await ca.commit(entries(pins, hashes, sums),
                    destination=endpoint(b))
    assert await cb.lookup(hashes) == 7  # all taken before Commit returned
    got = await cb.await_blocks(refs(hashes, sums), timeout=10)
    assert bytes_of(cb, got) == want
    stats = await cb.stats()
    assert (stats.num_checksum_failures, stats.num_refetches, stats.num_same_host) == (1, 1, 1)
    await cb.release([p.pin_id for p in got])
    for c in (ca, cb):
        await c.close()


async def test_a_same_host_copy_corrupted_twice_is_never_served_and_is_pulled_again(
        kvd_factory: Factory, redis_url: str) -> None:
    """The receiver's check stands for the sender's: a block whose copy fails it twice is
    dropped there (DATA_LOSS), while the sender, having checked it itself, holds it."""
    a = start(kvd_factory, redis_url)
    b = start(kvd_factory, redis_url, "--fault-same-host-corrupt-every", "1")
    ca, cb = await client(a), await client(b)
    pins, hashes, sums = await write(ca, 3)
    want = bytes_of(ca, pins)
    r = await ca.commit(entries(pins, hashes, sums),
                        destination=endpoint(b))
    assert (r.num_pushed, r.push_started) == (3, True)
    stats = await cb.stats()
    assert (stats.num_checksum_failures, stats.num_refetches) == (6, 3)
    assert (stats.slots_present, stats.slots_in_flight) == (0, 0)
    assert await cb.lookup(hashes) == 0 and await ca.lookup(hashes) == 3
    got = await cb.await_blocks(refs(hashes, sums), source=endpoint(a), timeout=10)
    assert bytes_of(cb, got) == want  # pulled over UCX (the hook corrupts same-host copies)
    await cb.release([p.pin_id for p in got])
    for c in (ca, cb):
        await c.close()


async def test_a_writers_wrong_checksum_fails_a_same_host_commit_and_is_served_nowhere(
        kvd_factory: Factory, redis_url: str) -> None:
    a, b = start(kvd_factory, redis_url), start(kvd_factory, redis_url)
    ca, cb = await client(a), await client(b)
    pins, hashes, sums = await write(ca, 3)
    sums[2] ^= 1
    with pytest.raises(grpc.RpcError) as err:
        await ca.commit(entries(pins, hashes, sums),
                        destination=endpoint(b))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(
        f"entries[2].checksum: does not match the bytes of slot {pins[2].slot}")
    assert await ca.lookup(hashes) == 0  # nothing published on the sender
    # the receiver took the two blocks that matched their checksums, not the third
    assert await cb.lookup(hashes[:2]) == 2 and await cb.lookup(hashes[2:]) == 0
    stats = await cb.stats()
    assert (stats.num_checksum_failures, stats.slots_in_flight, stats.slots_pinned) == (2, 0, 0)
    for c in (ca, cb):
        await c.close()


async def test_blocks_the_receiver_already_holds_are_checked_by_the_sender(
        kvd_factory: Factory, redis_url: str) -> None:
    """The receiver copies (and so checks) only blocks new to it; a Commit of blocks it holds
    is checked on the sender, and a wrong checksum there still fails it."""
    a, b = start(kvd_factory, redis_url), start(kvd_factory, redis_url)
    ca, cb = await client(a), await client(b)
    pins, hashes, sums = await write(ca, 2)
    await ca.commit(entries(pins, hashes, sums),
                    destination=endpoint(b))
    assert await cb.lookup(hashes) == 2
    # the same hashes and checksums again, on fresh slots whose bytes are not those blocks
    again = await ca.allocate(2)
    for p in again:
        ca.slot_view(p.slot).fill_(1.0)
    with pytest.raises(grpc.RpcError) as err:
        await ca.commit(entries(again, hashes, sums),
                        destination=endpoint(b))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("entries[0].checksum: does not match")
    assert (await cb.stats()).num_same_host == 1  # the second push moved nothing
    for c in (ca, cb):
        await c.close()


async def test_a_peer_killed_during_a_same_host_read_fails_closed_and_leaks_nothing(
        kvd_factory: Factory, redis_url: str) -> None:
    a = start(kvd_factory, redis_url)
    b = start(kvd_factory, redis_url, "--fault-same-host-delay-ms", "1500")
    ca, cb = await client(a), await client(b)
    pins, hashes, sums = await write(ca, 5)
    commit = asyncio.ensure_future(ca.commit(
        entries(pins, hashes, sums),
        destination=endpoint(b)))

    async def copied() -> bool:  # the copy is done; b waits before checking a is alive
        return (await cb.stats()).slots_in_flight == 5

    await eventually(copied)
    waiter = asyncio.ensure_future(cb.await_blocks(refs(hashes, sums), timeout=10))
    await asyncio.sleep(0.3)  # the Await waits on the blocks in flight
    a.kill()
    with pytest.raises(grpc.RpcError) as err:
        await waiter
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "the peer died during a same-host read" in (err.value.details() or "")
    with pytest.raises(grpc.RpcError):
        await commit  # its kvd is gone
    stats = await cb.stats()
    assert (stats.slots_in_flight, stats.slots_pinned, stats.slots_present) == (0, 0, 0)
    assert stats.num_errors == 1 and await cb.lookup(hashes) == 0
    pins, hashes, sums = await write(cb, 2)  # b serves on
    await cb.commit(entries(pins, hashes, sums))
    assert await cb.lookup(hashes) == 2
    await ca.close()
    await cb.close()


_OWNER = """
import os, sys
from pdserve.hashing import block_checksum
from pdserve.kvd import layout as L
from services.kvd import segments
name = segments.segment_name(sys.argv[1], os.getpid(), 7)
shm = segments.create(name, L.segment_bytes(4096, 4))
L.write_header(shm.buf, 4096, 4, 7, b"t" * 16)
shm.buf[L.HEADER_BYTES:L.HEADER_BYTES + 4096] = b"x" * 4096
print(name, flush=True)
sys.stdin.read()
"""


def test_a_mapping_outlives_its_killed_owner_and_its_unlinked_file() -> None:
    """What makes a dead peer harmless to a reader: its pages stay mapped here."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, f"t{uuid.uuid4().hex[:8]}"],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}"},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    name = owner.stdout.readline().strip()
    own = np.zeros(L.segment_bytes(4096, 1), np.uint8)
    mapper = SameHost(own, L.HEADER_BYTES, 4096)
    try:
        assert mapper.open(name, b"u" * 16) is None  # another pool of that name: not this one
        assert mapper.open(f"{segments.PREFIX}none-1-1", b"t" * 16) is None  # not here
        assert mapper.open("../etc/passwd", b"t" * 16) is None
        peer = mapper.open(name, b"t" * 16)
        assert peer is not None and peer.alive() and peer.num_slots == 4
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        (segments.SHM_DIR / name).unlink()
        assert not peer.alive() and map_segment(name) is None
        assert asyncio.run(mapper.copy(peer, [0], [0])) == [block_checksum(b"x" * 4096)]
        assert bytes(own[L.HEADER_BYTES:]) == b"x" * 4096  # read after death and unlink
        with pytest.raises(ValueError, match="peer slot 4 out of range 0..3"):
            asyncio.run(mapper.copy(peer, [4], [0]))
        assert mapper.open(name, b"t" * 16) is None  # a dead owner's mapping is dropped
    finally:
        owner.kill()
        (segments.SHM_DIR / name).unlink(missing_ok=True)


def test_a_large_copy_is_cut_into_runs_copied_by_threads_in_order() -> None:
    slot_bytes, num_slots = 64 << 10, 80  # 5 MiB: above INLINE_COPY_BYTES, so threaded
    assert num_slots * slot_bytes > INLINE_COPY_BYTES
    src_pool = np.random.default_rng(0).integers(
        0, 256, L.segment_bytes(slot_bytes, num_slots), dtype=np.uint8)
    peer = PeerPool("p", os.getpid(), b"t" * 16, slot_bytes, num_slots, src_pool)
    own = np.zeros(L.segment_bytes(slot_bytes, num_slots), np.uint8)
    mapper = SameHost(own, L.HEADER_BYTES, slot_bytes, threads=3)
    src = list(range(num_slots))
    dst = src[::-1]
    got = asyncio.run(mapper.copy(peer, src, dst))

    def slot(arr: np.ndarray, i: int) -> bytes:
        return bytes(arr[L.HEADER_BYTES + i * slot_bytes:L.HEADER_BYTES + (i + 1) * slot_bytes])

    assert got == [block_checksum(slot(src_pool, s)) for s in src]
    assert all(slot(own, d) == slot(src_pool, s) for s, d in zip(src, dst, strict=True))


@pytest.mark.parametrize(("tls", "shared"), [("", True), ("^cma", True), ("tcp,sm", True),
                                             ("^sm", False), ("tcp", False),
                                             ("^posix,sysv", False)])
def test_a_kvd_kept_off_shared_memory_by_ucx_tls_takes_no_same_host_path(
        tls: str, shared: bool) -> None:
    config = KvdConfig(ucx_tls=tls)
    mapper, offer = make(config, np.zeros(8192, np.uint8), 4096, "pdserve-kvd-x-1-1", b"t" * 16)
    assert shares_memory(tls) is shared
    assert (mapper is not None, offer[0]) == (shared, "pdserve-kvd-x-1-1" if shared else "")
    assert make(KvdConfig(same_host=False), np.zeros(8192, np.uint8), 4096, "n", b"t") == (
        None, ("", b""))
