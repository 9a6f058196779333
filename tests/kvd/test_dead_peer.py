"""Issue 14: a kvd pulling blocks from a peer kvd that dies (killed, or killed and restarted on
its address as the supervisor does) or is replaced (hung, and a new kvd registered in its place:
another UCX worker in the registry) answers the waiting Await with ABORTED within seconds, not
after its whole ``--transfer-timeout``, and holds nothing afterwards (two real kvds, real
Redis)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time

import grpc
import pytest

from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.kvd.client import CommitEntry
from tests.kvd.conftest import KvdProc, common_args
from tests.kvd.test_kvd_processes import Factory, client, endpoint, eventually, refs, start, write

TRANSFER_TIMEOUT = "20"  # what the pull would wait without detection


async def _pull_then(kvd_factory: Factory, redis_url: str, restart: bool = False,
                     replace: bool = False) -> None:
    b = start(kvd_factory, redis_url, "--transfer-timeout", TRANSFER_TIMEOUT)
    slow = start(kvd_factory, redis_url, "--fault-send-delay-ms", "30000")
    cb, cs = await client(b), await client(slow)
    pins, hashes, sums = await write(cs, 6)
    await cs.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)])
    waiter = asyncio.ensure_future(cb.await_blocks(refs(hashes, sums), source=endpoint(slow),
                                                   timeout=25.0))
    await asyncio.sleep(1.0)  # pulling: the source holds its sends back
    assert (await cb.stats()).slots_in_flight == 6
    t0 = time.monotonic()
    prefix, procs = kvd_factory
    if replace:  # hung, and registered anew: its record as a restarted kvd writes it
        slow.proc.send_signal(signal.SIGSTOP)
        index = RedisPrefixIndex(redis_url, prefix=prefix)
        old = next(n for n in await index.nodes() if n.node_id == slow.node_id)
        await index.register_node(dataclasses.replace(
            old, ucx_address=old.ucx_address[::-1], epoch=old.epoch + 1), ttl=30)
    else:
        slow.kill()
    restarted = None
    if restart:  # started again on the same address at once (a new epoch), as a supervisor does
        restarted = asyncio.ensure_future(asyncio.to_thread(
            KvdProc, *common_args(redis_url, prefix), node_id=slow.node_id, port=slow.port))
    with pytest.raises(grpc.RpcError) as err:
        await waiter
    if restarted is not None:
        procs.append(await restarted)
    assert err.value.code() == grpc.StatusCode.ABORTED  # the caller gets them elsewhere
    elapsed = time.monotonic() - t0
    print(f"aborted {elapsed:.2f}s after the kill: {err.value.details()}")
    assert elapsed < 5.0, err.value.details()

    async def released() -> bool:
        s = await cb.stats()
        return s.slots_pinned == 0 and s.slots_in_flight == 0

    await eventually(released)
    if replace:
        slow.proc.send_signal(signal.SIGCONT)
        await index.close()
    for c in (cb, cs):
        await c.close()


async def test_a_pull_from_a_killed_peer_is_aborted_at_once(kvd_factory: Factory,
                                                            redis_url: str) -> None:
    await _pull_then(kvd_factory, redis_url, restart=False)


async def test_a_pull_from_a_peer_restarted_in_its_place_is_aborted_at_once(
        kvd_factory: Factory, redis_url: str) -> None:
    await _pull_then(kvd_factory, redis_url, restart=True)



async def test_a_pull_from_a_peer_registered_anew_is_aborted_at_once(
        kvd_factory: Factory, redis_url: str) -> None:
    await _pull_then(kvd_factory, redis_url, replace=True)
