"""Moving blocks between kvds: the life cycle of a transfer.

    sender A (Commit with destination B)            receiver B
    ───────────────────────────────────            ──────────────────────────────────────
    pin the blocks (lease), Transfer(PUSH) ──gRPC──► skip blocks present or in flight here,
                                                     reserve IN_FLIGHT slots (may evict LRU),
                                                     register one future per hash,
                                                     post one UCX receive per message
    Commit returns (blocks are now "in flight" ◄──── reply: accepted, B's slots, B's address
    at B, so a later Await there waits on them)
    send the messages pool->pool over UCX ══UCX════► per message: xxh3 every block; good ->
    release the pins                                 PRESENT, index add, futures resolved
                                                     bad -> Transfer(PULL) of those blocks
                                                     from A into the same slots, once; bad
                                                     again -> slots freed, DATA_LOSS

A pull (Await on B for blocks neither present nor in flight) is the same receive path, started
by B: reserve slots, Transfer(PULL) to the source with B's slots, A pins and sends.

Watchdogs: a receive whose peer's gRPC channel goes down, whose peer registered anew (another
UCX worker address in the registry: it restarted, its sends are gone), or that makes no
progress for ``transfer_timeout``, aborts the UCX endpoint (cancelling its posted receives),
frees the slots and fails the futures with ABORTED (an Await waiting on them fails at once: its
caller must get the blocks elsewhere, e.g. compute them again); a send likewise releases its
pins. A pull whose source cannot be reached fails the same way.
A message's plan is the maximal runs contiguous in both pools (``transfer.plan_messages``).
On one host a push skips UCX: the receiver copies from the sender's mapped pool while the
sender waits for its answer, and its check of each copied block stands for the sender's own
(a Commit pushes before it publishes; ``samehost`` has that order).
``sending`` has the sender's side, ``receiving`` the receiver's, ``link`` what they share;
``Shipper`` here is the one face the daemon sees.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pdserve.proto.v1 import common_pb2, kvd_pb2
from services.kvd.link import Link
from services.kvd.receiving import Receiver
from services.kvd.sending import CheckedPush, Sender


class Shipper:
    """Push, pull and receive of blocks for one kvd (see the module docstring)."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self._sender = Sender(self._link)
        self._receiver = Receiver(self._link)
        self.pool = link.pool
        self.slot_bytes = link.slot_bytes
        self.kv_dtype = link.kv_dtype
        self.codec = link.codec
        self.counters = self._link.counters
        self.inbound: dict[bytes, asyncio.Future[None]] = self._receiver.inbound

    async def stop(self) -> None:
        await self._link.stop()

    def slot_view(self, slot: int) -> memoryview:
        return self._link.slot_view(slot)

    async def push(self, dest: common_pb2.KvdEndpoint, slots: Sequence[int]) -> int | None:
        """Announce ``slots``' blocks to ``dest`` and start sending; None if unreachable."""
        return await self._sender.push(dest, slots)

    async def push_written(self, dest: common_pb2.KvdEndpoint,
                           entries: Sequence[kvd_pb2.CommitEntry]) -> CheckedPush | None:
        """Same-host push of a Commit's written, unpublished blocks, checked by the receiver;
        None if ``dest`` is not on this host (``Sender.push_written``)."""
        return await self._sender.push_written(dest, entries)

    def serve_pull(self, req: kvd_pb2.TransferRequest) -> kvd_pb2.TransferResponse:
        """A peer asks for blocks it lacks: pin those present here and start sending them."""
        return self._sender.serve_pull(req)

    async def serve_push(self, req: kvd_pb2.TransferRequest) -> kvd_pb2.TransferResponse:
        """A peer announces blocks: reserve slots for those new here and post the receives."""
        return await self._receiver.serve_push(req)

    def start_pull(self, source: common_pb2.KvdEndpoint, hashes: list[bytes],
                   checksums: list[int]) -> None:
        """Reserve slots and register the blocks as in flight now; fetch in the background."""
        self._receiver.start_pull(source, hashes, checksums)
