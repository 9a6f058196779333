"""Await's wait: pin the blocks present here, wait for those in flight, pull the rest from the
given or indexed source; on any failure every pin the Await took is released."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import grpc

from pdserve.errors import StatusError
from pdserve.index import IndexUnavailable, PrefixIndex
from pdserve.proto.v1 import common_pb2
from services.kvd.peering import PeerGate
from services.kvd.pool import PinRecord
from services.kvd.shipping import Shipper

SourceFor = Callable[[Sequence[common_pb2.BlockRef], list[int], common_pb2.KvdEndpoint | None],
                     Awaitable[common_pb2.KvdEndpoint]]


async def await_blocks(ship: Shipper, refs: Sequence[common_pb2.BlockRef],
                       source: common_pb2.KvdEndpoint | None, lease_s: float, client_id: str,
                       timeout: float, source_for: SourceFor) -> list[PinRecord]:
    """Pins on every block of ``refs`` (validated by the caller), in order."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pins: dict[int, PinRecord] = {}
    pulled = False
    try:
        while True:
            missing = pin_present(ship, refs, pins, client_id, lease_s)
            if not missing:
                return [pins[i] for i in range(len(refs))]
            to_pull = [i for i in missing if refs[i].hash not in ship.inbound]
            if to_pull and not pulled:
                src = await source_for(refs, to_pull, source)
                ship.start_pull(src, [refs[i].hash for i in to_pull],
                                [refs[i].checksum for i in to_pull])
                pulled = True
                continue
            if to_pull:
                raise StatusError(grpc.StatusCode.NOT_FOUND,
                                  f"blocks[{to_pull[0]}]: block "
                                  f"{refs[to_pull[0]].hash.hex()[:16]} was evicted while "
                                  "awaited")
            waiting = [ship.inbound[refs[i].hash] for i in missing]
            done, _ = await asyncio.wait(waiting, timeout=deadline - loop.time(),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"blocks: {len(missing)} of {len(refs)} not present within "
                                  f"the deadline ({timeout:.3g}s)")
            for fut in done:
                fut.result()  # raises the transfer's StatusError
    except BaseException:
        for pin in pins.values():
            ship.pool.release(pin.pin_id)
        raise


def pin_present(ship: Shipper, refs: Sequence[common_pb2.BlockRef], pins: dict[int, PinRecord],
                client_id: str, lease_s: float) -> list[int]:
    """Pin each block of ``refs`` present here not pinned yet (into ``pins``, by position);
    return the positions still missing."""
    missing = []
    for i, r in enumerate(refs):
        if i in pins:
            continue
        pin = ship.pool.pin_present(r.hash, client_id, lease_s)
        if pin is None:
            missing.append(i)
            continue
        # A present block was verified against its own checksum when it arrived (or was
        # committed here). The caller's checksum may differ: two prefill engines that
        # computed the same prefix in different chunks or batches produce the same block
        # hash with bits that differ in the last place. Both are that prefix's KV, so the
        # block here serves; the checksum guards transit, not provenance.
        pins[i] = pin
    return missing


async def find_source(index: PrefixIndex | None, gate: PeerGate,
                      refs: Sequence[common_pb2.BlockRef], to_pull: list[int],
                      source: common_pb2.KvdEndpoint | None) -> common_pb2.KvdEndpoint:
    """Where to pull ``refs[to_pull]`` from: ``source`` if given (a registered node), else
    the node the index says holds the longest run of them; NOT_FOUND if none."""
    if source is not None and source.address:
        await gate.check(source, "source")
        return common_pb2.KvdEndpoint(node_id=source.node_id or source.address,
                                      address=source.address)
    not_found = StatusError(grpc.StatusCode.NOT_FOUND, f"blocks[{to_pull[0]}]: block "
                            f"{refs[to_pull[0]].hash.hex()[:16]} is not here, not in flight, "
                            "and no source was given or found in the index")
    if index is None:
        raise not_found
    try:
        counts = await index.lookup([r.hash for r in refs])
        records = {n.node_id: n for n in await index.nodes()}
    except IndexUnavailable as exc:
        raise not_found from exc
    holders = [(c, n) for n, c in counts.items()
               if n != gate.me.node_id and n in records and c > max(to_pull)]
    if not holders:
        raise not_found
    best = records[max(holders)[1]]
    return common_pb2.KvdEndpoint(node_id=best.node_id, address=best.address)
