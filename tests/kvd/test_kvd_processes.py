"""Two (or more) real kvd processes, real UCX over loopback, real Redis (the private server)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable

import grpc
import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.hashing import block_checksum, hash_blocks
from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.kvd.client import CommitEntry, KvdClient, Pin
from pdserve.kvd.layout import BlockLayout
from pdserve.proto.v1 import common_pb2, kvd_pb2
from tests.conftest import RedisServer, free_port
from tests.kvd.conftest import BLOCK, ROOT, KvdProc, common_args

Factory = tuple[str, list[KvdProc]]


def start(factory: Factory, redis_url: str, *extra: str, node_id: str = "",
          secret: str = "", log_level: str = "warning") -> KvdProc:
    prefix, procs = factory
    p = KvdProc(*common_args(redis_url, prefix, *extra), node_id=node_id, secret=secret,
                log_level=log_level)
    procs.append(p)
    return p


def endpoint(p: KvdProc) -> common_pb2.KvdEndpoint:
    return common_pb2.KvdEndpoint(node_id=p.node_id, address=p.address)


async def client(p: KvdProc, layout: BlockLayout | None = None, secret: str = "") -> KvdClient:
    c = KvdClient(p.address, f"test-{p.port}", secret=secret)
    await c.register(layout or BlockLayout(**BLOCK))  # type: ignore[arg-type]
    return c


_counter = [0]


async def write(c: KvdClient, n: int) -> tuple[list[Pin], list[bytes], list[int]]:
    """Allocate n slots, fill them with random KV, return pins, fresh hashes, checksums."""
    _counter[0] += 1
    hashes = hash_blocks(list(range(n * 4)), 4, f"test-{_counter[0]}-{time.time()}")
    pins = await c.allocate(n)
    for p in pins:
        c.slot_view(p.slot).copy_(torch.randn(c.layout.shape).to(torch.float16))  # type: ignore
    return pins, hashes, [block_checksum(c.slot_memory(p.slot)) for p in pins]


def entries(pins: list[Pin], hashes: list[bytes], sums: list[int]) -> list[CommitEntry]:
    """A Commit's entries: each written slot with its hash and the writer's checksum."""
    return [CommitEntry(p, h, s) for p, h, s in zip(pins, hashes, sums, strict=True)]


def refs(hashes: list[bytes], sums: list[int]) -> list[common_pb2.BlockRef]:
    return [common_pb2.BlockRef(hash=h, checksum=s) for h, s in zip(hashes, sums, strict=True)]


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def pinning_client(script: str, address: str, observer: KvdClient,
                         pins: int = 5) -> subprocess.Popen[str]:
    """Run ``script`` (a client process that pins ``pins`` slots of the kvd at ``address``, then
    prints how many and waits); return once ``observer`` sees them pinned."""
    proc = subprocess.Popen([sys.executable, "-c", script, address], cwd=ROOT,
                            env={"PYTHONPATH": f"{ROOT / 'libs'}"}, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == str(pins)
    assert (await observer.stats()).slots_pinned == pins
    return proc


def bytes_of(c: KvdClient, pins: list[Pin]) -> list[bytes]:
    return [bytes(c.slot_memory(p.slot)) for p in pins]


async def test_push_and_pull_bit_exact_and_index_agrees(kvd_factory: Factory,
                                                       redis_url: str) -> None:
    a, b = start(kvd_factory, redis_url), start(kvd_factory, redis_url)
    ca, cb = await client(a), await client(b)
    index = RedisPrefixIndex(redis_url, prefix=kvd_factory[0])
    for n in (1, 17, 1000):
        for mode in ("push", "pull"):
            pins, hashes, sums = await write(ca, n)
            want = bytes_of(ca, pins)
            dest = endpoint(b) if mode == "push" else None
            r = await ca.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                                destination=dest)
            assert (r.num_pushed, r.push_started) == ((n, True) if mode == "push" else (0, False))
            source = endpoint(a) if mode == "pull" else None
            got = await cb.await_blocks(refs(hashes, sums), source=source, timeout=20)
            assert bytes_of(cb, got) == want, f"{n} blocks by {mode} not bit-exact"
            await cb.release([p.pin_id for p in got])
            assert await ca.lookup(hashes) == n and await cb.lookup(hashes) == n

            async def indexed(hs: list[bytes] = hashes, k: int = n) -> bool:
                return await index.lookup(hs) == {a.node_id: k, b.node_id: k}

            await eventually(indexed)
    sb = await cb.stats()
    assert sb.slots_present == 2036 and sb.slots_pinned == 0 and sb.slots_in_flight == 0
    assert sb.num_checksum_failures == 0 and sb.bytes_in == 2036 * 4096
    assert (await ca.stats()).bytes_out == 2036 * 4096
    await index.close()
    await ca.close()
    await cb.close()


async def test_corrupt_block_refetched_then_persistent_corruption_fails(
        kvd_factory: Factory, redis_url: str) -> None:
    b = start(kvd_factory, redis_url)
    flaky = start(kvd_factory, redis_url, "--fault-corrupt-every", "7")
    broken = start(kvd_factory, redis_url, "--fault-corrupt-every", "1")
    cb, cf, cx = await client(b), await client(flaky), await client(broken)

    pins, hashes, sums = await write(cf, 17)  # blocks 7 and 14 arrive corrupted, refetched
    want = bytes_of(cf, pins)
    await cf.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                    destination=endpoint(b))
    got = await cb.await_blocks(refs(hashes, sums), timeout=10)
    assert bytes_of(cb, got) == want
    stats = await cb.stats()
    assert stats.num_checksum_failures == 2 and stats.num_refetches == 2

    pins, hashes, sums = await write(cx, 3)  # every block corrupted, refetch corrupted too
    await cx.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                    destination=endpoint(b))
    with pytest.raises(grpc.RpcError) as err:
        await cb.await_blocks(refs(hashes, sums), timeout=10)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert "checksum mismatch twice" in (err.value.details() or "")
    stats = await cb.stats()
    assert stats.slots_in_flight == 0 and stats.slots_pinned == 17
    assert await cb.lookup(hashes) == 0
    for c in (cb, cf, cx):
        await c.close()


async def test_killing_sender_mid_transfer(kvd_factory: Factory, redis_url: str) -> None:
    b = start(kvd_factory, redis_url)
    slow = start(kvd_factory, redis_url, "--fault-send-delay-ms", "30000")
    cb, cs = await client(b), await client(slow)
    local_pins, local_hashes, local_sums = await write(cb, 3)  # present on B already
    await cb.commit([CommitEntry(p, h) for p, h in zip(local_pins, local_hashes, strict=True)])
    pins, hashes, sums = await write(cs, 20)
    r = await cs.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                        destination=endpoint(b))
    assert r.num_pushed == 20
    assert (await cb.stats()).slots_in_flight == 20
    waiter = asyncio.ensure_future(cb.await_blocks(
        refs(local_hashes + hashes, local_sums + sums), timeout=4.0))
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    slow.kill()
    with pytest.raises(grpc.RpcError) as err:
        await waiter
    assert time.monotonic() - t0 < 4.0
    assert err.value.code() == grpc.StatusCode.ABORTED  # get them elsewhere
    assert "aborted" in (err.value.details() or "")

    async def released() -> bool:
        s = await cb.stats()
        return s.slots_pinned == 0 and s.slots_in_flight == 0 and s.slots_present == 3

    await eventually(released)
    fresh = start(kvd_factory, redis_url)  # B still serves transfers
    cf = await client(fresh)
    pins, hashes, sums = await write(cf, 17)
    want = bytes_of(cf, pins)
    await cf.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                    destination=endpoint(b))
    got = await cb.await_blocks(refs(hashes, sums), timeout=10)
    assert bytes_of(cb, got) == want
    for c in (cb, cs, cf):
        await c.close()


_DYING_CLIENT = """
import asyncio, sys
from pdserve.kvd.client import KvdClient
from pdserve.kvd.layout import BlockLayout
async def main():
    c = KvdClient(sys.argv[1], "doomed")
    await c.register(BlockLayout(2, 16, 2, 16, "float16"))
    pins = await c.allocate(5, lease_ms=400)
    print(len(pins), flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


async def test_pins_of_a_dead_client_expire(kvd_factory: Factory, redis_url: str) -> None:
    b = start(kvd_factory, redis_url)
    cb = await client(b)
    proc = await pinning_client(_DYING_CLIENT, b.address, cb)
    try:
        proc.kill()
        proc.wait(timeout=10)

        async def expired() -> bool:
            s = await cb.stats()
            return s.slots_pinned == 0 and s.slots_free == s.num_slots

        await eventually(expired, timeout=3.0)
        assert (await cb.stats()).num_lease_expiries == 5
    finally:
        proc.kill()
    await cb.close()


async def test_registered_peers_stay_allowed_while_redis_is_down(kvd_factory: Factory) -> None:
    """Push destinations must be registered nodes; a kvd learns the registry every heartbeat,
    so a Redis outage (or Redis out of this node's reach) does not turn a registered peer it
    never sent to yet into a refused one."""
    redis_server = RedisServer(free_port())
    redis_server.start()
    try:
        a = start(kvd_factory, redis_server.url)
        b = start(kvd_factory, redis_server.url)
        ca, cb = await client(a), await client(b)
        await asyncio.sleep(1.0)  # a few heartbeats: each kvd has read the registry back
        redis_server.stop()
        pins, hashes, sums = await write(ca, 3)
        want = bytes_of(ca, pins)
        r = await ca.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                            destination=endpoint(b))
        assert (r.num_pushed, r.push_started) == (3, True)
        got = await cb.await_blocks(refs(hashes, sums), timeout=10)
        assert bytes_of(cb, got) == want
        await cb.release([p.pin_id for p in got])
        for c in (ca, cb):
            await c.close()
    finally:
        redis_server.stop()


async def test_full_pool_eviction_restart_purge_and_bad_input(kvd_factory: Factory,
                                                             redis_url: str) -> None:
    big = BlockLayout(8, 16, 2, 16, "float16")  # 16 KiB: 1 MiB pool = 64 slots
    args = ("--capacity-mib", "1", "--max-batch-blocks", "64", "--max-client-share", "1")
    c_proc = start(kvd_factory, redis_url, *args, node_id="node-c", secret="s3")
    c = await client(c_proc, big, secret="s3")
    index = RedisPrefixIndex(redis_url, prefix=kvd_factory[0])

    pins, hashes, _ = await write(c, 64)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        await c.allocate(1)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - t0 < 0.5
    await c.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)])

    async def all_indexed() -> bool:
        return await index.lookup(hashes) == {"node-c": 64}

    await eventually(all_indexed)
    extra = await c.allocate(10)  # evicts the 10 least recently used: the first 10 committed
    assert await c.lookup(hashes) == 0 and await c.lookup(hashes[10:]) == 54

    async def evictions_indexed() -> bool:
        return (await index.lookup(hashes) == {}
                and await index.lookup(hashes[10:]) == {"node-c": 54})

    await eventually(evictions_indexed)
    assert (await c.stats()).num_evictions == 10

    await _bad_input(c, extra, c_proc.address)

    raw = redis.Redis.from_url(redis_url)
    keys = [f"{kvd_factory[0]}blk:{h.hex()}" for h in hashes[10:]]
    assert all(raw.zscore(k, "node-c") for k in keys)
    c_proc.kill()  # a restarted kvd purges its previous epoch's entries
    c2 = start(kvd_factory, redis_url, *args, node_id="node-c", secret="s3")
    epoch = (await _stats(c2)).epoch

    async def purged() -> bool:  # raw entries, not the liveness-filtered lookup
        nodes = await index.nodes()
        return [n.epoch for n in nodes] == [epoch] and not any(
            raw.zscore(k, "node-c") for k in keys)

    await eventually(purged)
    raw.close()
    await index.close()
    await c.close()


async def _stats(p: KvdProc) -> kvd_pb2.KvdStats:
    c = KvdClient(p.address, "stats", secret="s3")
    try:
        return await c.stats()
    finally:
        await c.close()


async def _expect(call: Awaitable[object], code: grpc.StatusCode, text: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    assert text in (err.value.details() or ""), err.value.details()


async def _bad_input(c: KvdClient, pins: list[Pin], address: str) -> None:
    bad = CommitEntry(Pin(99, pins[0].pin_id), b"x" * 32, checksum=1)
    inv = grpc.StatusCode.INVALID_ARGUMENT
    await _expect(c.commit([bad]), inv, "entries[0].slot: slot 99 out of range 0..63")
    short = CommitEntry(pins[0], b"short", checksum=1)
    await _expect(c.commit([short]), inv, "entries[0].hash: a block hash is 32 bytes, got 5")
    await _expect(c.commit([CommitEntry(Pin(pins[0].slot, 777777), b"y" * 32, checksum=1)]),
                  inv, "entries[0].pin_id: 777777 is not a live Allocate pin")
    await _expect(c.register(BlockLayout(**BLOCK)), inv,  # type: ignore[arg-type]
                  "layout: blocks of 4096 bytes, but this pool's slots hold 16384")
    await _expect(c.allocate(65), inv, "num_slots: 65 items, more than --max-batch-blocks 64")
    await _expect(c.lookup([b"z" * 32] * 65), inv, "hashes: 65 items")
    await _expect(c.release([424242]), inv, "pin_ids: unknown or expired pin 424242")
    await _expect(c.await_blocks([common_pb2.BlockRef(hash=b"q" * 32)], timeout=2),
                  grpc.StatusCode.NOT_FOUND, "blocks[0]: block")
    stranger = KvdClient(address, "stranger")
    await _expect(stranger.stats(), grpc.StatusCode.UNAUTHENTICATED, "x-pdserve-secret")
    await stranger.close()


async def test_same_block_from_two_engines_with_other_low_bits_is_served(
        kvd_factory: Factory, redis_url: str) -> None:
    """Two prefill nodes compute the same prefix (same chained hash) with bits differing in the
    last place; the decode node already holds one copy. Await must serve it, not DATA_LOSS."""
    a, b = start(kvd_factory, redis_url), start(kvd_factory, redis_url)
    ca, cb = await client(a), await client(b)
    pins, hashes, _ = await write(ca, 3)
    await ca.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                    destination=endpoint(b))
    first = await cb.await_blocks(refs(hashes, [0] * 3), timeout=20)
    held = bytes_of(cb, first)
    await cb.release([p.pin_id for p in first])
    other_sums = [block_checksum(bytes(x ^ 1 for x in blk[:8]) + blk[8:]) for blk in held]
    got = await cb.await_blocks(refs(hashes, other_sums), timeout=20)
    assert bytes_of(cb, got) == held
    await cb.release([p.pin_id for p in got])
    await ca.close()
    await cb.close()


def _lanes(metrics_text: str, peer: str) -> dict[str, float]:
    """``pdserve_kvd_ucx_lanes`` samples towards ``peer``: transport/device -> lane count."""
    out = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "pdserve_kvd_ucx_lanes" and s.labels["peer"] == peer:
                out[s.labels["transport"]] = s.value
    return out


@pytest.mark.parametrize("tls", ["^cma", "tcp"])
async def test_ucx_reports_the_transports_it_uses(kvd_factory: Factory, redis_url: str,
                                                  tls: str) -> None:
    """UCX's own answer (ucp_ep_query), in kvd's metrics and log: on one host the default
    (everything but CMA) takes shared memory; restricted to TCP, only tcp/lo lanes."""
    a = start(kvd_factory, redis_url, "--ucx-tls", tls, "--metrics-port", "0",
              "--same-host", "false", node_id="lanes-a", log_level="info")
    b = start(kvd_factory, redis_url, "--ucx-tls", tls, "--same-host", "false",
              node_id="lanes-b")
    ca, cb = await client(a), await client(b)
    pins, hashes, sums = await write(ca, 3)
    await ca.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                    destination=endpoint(b))
    got = await cb.await_blocks(refs(hashes, sums), timeout=10)
    await cb.release([p.pin_id for p in got])
    assert a.metrics_port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{a.metrics_port}/metrics") as resp:
        lanes = _lanes(resp.read().decode(), "lanes-b")
    if tls == "tcp":
        assert set(lanes) == {"tcp/lo"}, lanes
    else:
        assert {"posix/memory", "sysv/memory"} & set(lanes), lanes
    for c in (ca, cb):
        await c.close()
    log = a.stop()
    assert "ucx endpoint" in log and "lanes-b" in log
