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
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from pdserve.errors import StatusError
from pdserve.hashing import block_checksum
from pdserve.kvd.layout import QUANTIZED
from pdserve.proto.v1 import common_pb2, kvd_pb2
from pdserve.telemetry import outbound_metadata
from services.kvd import metrics, wirecodec
from services.kvd.index_sync import IndexSync
from services.kvd.peers import Peers
from services.kvd.pool import PinRecord, Pool
from services.kvd.transfer import Message, TransportError, UcxTransport
from services.kvd.wirecodec import WireCodec

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0
_PUSH, _PULL = kvd_pb2.TransferRequest.DIRECTION_PUSH, kvd_pb2.TransferRequest.DIRECTION_PULL
# Verify a message on the loop as it lands, still in cache (8 MiB: under 1 ms; a thread hop
# per message cost more than it saved here); only larger ones in a thread (xxhash frees the GIL).
_THREAD_VERIFY_BYTES = 16 << 20


@dataclass
class Counters:
    bytes_in: int = 0
    bytes_out: int = 0
    num_transfers: int = 0
    num_errors: int = 0
    num_checksum_failures: int = 0
    num_refetches: int = 0


@dataclass
class Inbound:
    """Blocks on their way here from one peer, in one transfer."""

    transfer_id: int
    peer: common_pb2.KvdEndpoint
    hashes: list[bytes]
    slots: list[int]  # this pool's
    checksums: list[int]
    attempt: int = 0
    codec: str = ""  # negotiated for this transfer; "" = raw bytes
    peer_ucx: bytes = b""  # the peer's UCX worker address: another one registered = restarted


class Shipper:
    """Push, pull and receive of blocks for one kvd (see the module docstring)."""

    def __init__(self, pool: Pool, arr: np.ndarray, data_offset: int, slot_bytes: int,
                 transport: UcxTransport, peers: Peers, sync: IndexSync,
                 me: common_pb2.KvdEndpoint, transfer_timeout: float,
                 kv_dtype: str = "", codec: WireCodec | None = None) -> None:
        self.pool = pool
        self._arr = arr
        self._data_offset = data_offset
        self.slot_bytes = slot_bytes
        self._transport = transport
        self._peers = peers
        self._sync = sync
        self._me = me
        self._timeout = transfer_timeout
        self.kv_dtype = kv_dtype  # announced in every Transfer; the peer refuses a mismatch
        self.codec = codec  # offered per transfer, used if the peer accepts (wirecodec.py)
        self._offer = "" if codec is None or kv_dtype in QUANTIZED else codec.name
        self.counters = Counters()
        self.inbound: dict[bytes, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def slot_view(self, slot: int) -> memoryview:
        start = self._data_offset + slot * self.slot_bytes
        return self._arr[start:start + self.slot_bytes].data

    def _pin_for_transfer(self, slot: int) -> PinRecord:
        h = self.pool.slots[slot].hash
        pin = self.pool.pin_present(h, "kvd:transfer", 2 * self._timeout + RPC_TIMEOUT_S)
        assert pin is not None
        return pin

    # -- sender side -----------------------------------------------------------------------
    async def push(self, dest: common_pb2.KvdEndpoint, slots: Sequence[int]) -> int | None:
        """Announce ``slots``' blocks to ``dest`` and start sending; None if unreachable."""
        pins = [self._pin_for_transfer(s) for s in slots]
        refs = [common_pb2.BlockRef(hash=self.pool.slots[s].hash,
                                    checksum=self.pool.slots[s].checksum) for s in slots]
        tid = secrets.randbits(64)
        req = kvd_pb2.TransferRequest(direction=_PUSH, peer=self._me, blocks=refs,
                                      ucx_address=self._transport.address, transfer_id=tid,
                                      slots=list(slots), slot_bytes=self.slot_bytes,
                                      kv_dtype=self.kv_dtype, codec=self._offer)
        try:
            resp = await self._peers.stub(dest.address).Transfer(
                req, timeout=RPC_TIMEOUT_S, metadata=outbound_metadata(self._peers.metadata))
        except grpc.RpcError as exc:
            log.warning("push announce failed", extra={"fields": {"dest": dest.address,
                                                                  "error": str(exc)}})
            self.counters.num_errors += 1
            self._release(pins)
            return None
        sent = [p for p, ok in zip(pins, resp.accepted, strict=False) if ok]
        self._release([p for p, ok in zip(pins, resp.accepted, strict=False) if not ok])
        if sent:
            messages = self._transport.plan([p.slot for p in sent], list(resp.slots))
            self._spawn(self._send(dest, resp.ucx_address, tid, messages, sent,
                                   self._agreed(resp.codec)))
        return len(sent)

    def serve_pull(self, req: kvd_pb2.TransferRequest) -> kvd_pb2.TransferResponse:
        """A peer asks for blocks it lacks: pin those present here and start sending them."""
        accepted, pins, checksums = [], [], []
        for ref in req.blocks:
            slot = self.pool.by_hash.get(ref.hash)
            accepted.append(slot is not None)
            checksums.append(0 if slot is None else self.pool.slots[slot].checksum)
            if slot is not None:
                pins.append(self._pin_for_transfer(slot))
        dst = [s for s, ok in zip(req.slots, accepted, strict=True) if ok]
        codec = self._accept(req.codec)
        if pins:
            messages = self._transport.plan([p.slot for p in pins], dst)
            self._spawn(self._send(req.peer, req.ucx_address, req.transfer_id, messages, pins,
                                   self._agreed(codec)))
        return kvd_pb2.TransferResponse(accepted=accepted, ucx_address=self._transport.address,
                                        slots=[p.slot for p in pins], checksums=checksums,
                                        codec=codec)

    def _accept(self, offered: str) -> str:
        return wirecodec.accept(offered, self._offer, self.kv_dtype in QUANTIZED)

    def _agreed(self, codec: str) -> WireCodec | None:
        return self.codec if codec and self.codec is not None and codec == self.codec.name \
            else None

    async def _send(self, dest: common_pb2.KvdEndpoint, address: bytes, tid: int,
                    messages: list[Message], pins: list[PinRecord],
                    codec: WireCodec | None = None) -> None:
        try:
            with metrics.transfer(self._me.node_id, "out", dest.node_id, len(pins),
                                  len(pins) * self.slot_bytes):
                ep = await self._transport.endpoint(dest.node_id, address)
                send = asyncio.ensure_future(self._transport.send(ep, tid, messages, codec))
                await self._watch(send, dest)
            self.counters.bytes_out += len(pins) * self.slot_bytes
            self.counters.num_transfers += 1
        except (StatusError, TransportError) as exc:
            log.warning("send failed", extra={"fields": {"dest": dest.node_id, "error": str(exc)}})
            self.counters.num_errors += 1
            self._transport.drop(dest.node_id)
        finally:
            self._release(pins)

    async def _watch(self, task: asyncio.Future[None], peer: common_pb2.KvdEndpoint) -> None:
        """Wait for ``task``; fail if the peer goes down or it outlives the transfer timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while not task.done():
            await asyncio.wait([task], timeout=0.25)
            if task.done():
                break
            if self._peers.is_down(peer.address) or loop.time() > deadline:
                task.cancel()
                self._transport.drop(peer.node_id)
                raise StatusError(grpc.StatusCode.UNAVAILABLE,
                                  f"peer {peer.node_id} lost or stalled mid-transfer")
        task.result()

    def _release(self, pins: list[PinRecord]) -> None:
        for p in pins:
            self.pool.release(p.pin_id)

    # -- receiver side ---------------------------------------------------------------------
    async def serve_push(self, req: kvd_pb2.TransferRequest) -> kvd_pb2.TransferResponse:
        """A peer announces blocks: reserve slots for those new here and post the receives."""
        accepted = [ref.hash not in self.pool.by_hash and ref.hash not in self.inbound
                    for ref in req.blocks]
        room = self.pool.num_free + self.pool.num_evictable
        for i, ok in enumerate(accepted):  # take what fits; the rest the peer keeps
            if ok:
                accepted[i], room = room > 0, room - 1
        refs = [ref for ref, ok in zip(req.blocks, accepted, strict=True) if ok]
        src = [s for s, ok in zip(req.slots, accepted, strict=True) if ok]
        slots = self._reserve([r.hash for r in refs])
        tr = Inbound(req.transfer_id, req.peer, [r.hash for r in refs], slots,
                     [r.checksum for r in refs], codec=self._accept(req.codec),
                     peer_ucx=req.ucx_address)
        if refs:
            try:
                ep = await self._transport.endpoint(req.peer.node_id, req.ucx_address)
            except TransportError as exc:
                err = StatusError(grpc.StatusCode.UNAVAILABLE, str(exc))
                self._fail(tr, range(len(refs)), err)
                raise err from exc
            self._spawn(self._receive(tr, ep, self._transport.plan(src, slots)))
        return kvd_pb2.TransferResponse(accepted=accepted, ucx_address=self._transport.address,
                                        slots=slots, codec=tr.codec)

    def _reserve(self, hashes: list[bytes]) -> list[int]:
        slots = self.pool.reserve(hashes) if hashes else []
        self._sync.removed(self.pool.counters.evicted)
        self.pool.counters.evicted = []
        loop = asyncio.get_running_loop()
        for h in hashes:
            fut: asyncio.Future[None] = loop.create_future()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
            self.inbound[h] = fut
        return slots

    def start_pull(self, source: common_pb2.KvdEndpoint, hashes: list[bytes],
                   checksums: list[int]) -> None:
        """Reserve slots and register the blocks as in flight now; fetch in the background."""
        slots = self._reserve(hashes)
        tr = Inbound(secrets.randbits(64), source, hashes, slots, checksums)
        self._spawn(self._pull(tr))

    async def _pull(self, tr: Inbound) -> None:
        refs = [common_pb2.BlockRef(hash=h) for h in tr.hashes]
        req = kvd_pb2.TransferRequest(direction=_PULL, peer=self._me, blocks=refs,
                                      ucx_address=self._transport.address,
                                      transfer_id=tr.transfer_id, slots=tr.slots,
                                      slot_bytes=self.slot_bytes,
                                      kv_dtype=self.kv_dtype, codec=self._offer)
        try:
            resp = await self._peers.stub(tr.peer.address).Transfer(
                req, timeout=RPC_TIMEOUT_S, metadata=outbound_metadata(self._peers.metadata))
        except grpc.RpcError as exc:
            self._fail(tr, range(len(tr.hashes)), StatusError(
                grpc.StatusCode.ABORTED, f"source {tr.peer.node_id or tr.peer.address} "
                f"unreachable: {exc.code().name}"))  # type: ignore[attr-defined]
            return
        missing = [i for i, ok in enumerate(resp.accepted) if not ok]
        self._fail(tr, missing, StatusError(grpc.StatusCode.NOT_FOUND,
                                            f"source {tr.peer.node_id} does not hold the block"))
        keep = [i for i, ok in enumerate(resp.accepted) if ok]
        if not keep:
            return
        sums = [tr.checksums[i] or resp.checksums[i] for i in keep]
        got = Inbound(tr.transfer_id, tr.peer, [tr.hashes[i] for i in keep],
                      [tr.slots[i] for i in keep], sums, tr.attempt, resp.codec,
                      resp.ucx_address)
        try:
            ep = await self._transport.endpoint(tr.peer.node_id, resp.ucx_address)
        except TransportError as exc:
            self._fail(got, range(len(keep)), StatusError(grpc.StatusCode.ABORTED, str(exc)))
            return
        await self._receive(got, ep, self._transport.plan(list(resp.slots), got.slots))

    async def _receive(self, tr: Inbound, ep: object, messages: list[Message]) -> None:
        with metrics.transfer(self._me.node_id, "in", tr.peer.node_id, len(tr.hashes),
                              len(tr.hashes) * self.slot_bytes):
            await self._receive_all(tr, ep, messages)

    async def _receive_all(self, tr: Inbound, ep: object, messages: list[Message]) -> None:
        tasks = self._transport.post_receives(ep, tr.transfer_id, messages,
                                              self._agreed(tr.codec))
        firsts = np.cumsum([0] + [m.num_blocks for m in messages]).tolist()
        bad: list[int] = []
        done_msgs: set[int] = set()
        loop = asyncio.get_running_loop()
        last = loop.time()
        pending: set[asyncio.Task[int]] = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, timeout=0.25,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    i = t.result()
                    done_msgs.add(i)
                    bad += await self._verify(tr, range(firsts[i], firsts[i + 1]))
                if done:
                    last = loop.time()
                elif self._peers.is_down(tr.peer.address):
                    raise StatusError(grpc.StatusCode.ABORTED, f"transfer from "
                                      f"{tr.peer.node_id} aborted: peer lost mid-transfer")
                elif self._peers.restarted(tr.peer.address, tr.peer_ucx):
                    raise StatusError(grpc.StatusCode.ABORTED, f"transfer from "
                                      f"{tr.peer.node_id} aborted: peer restarted mid-transfer "
                                      "(registered anew)")
                elif loop.time() - last > self._timeout:
                    raise StatusError(grpc.StatusCode.ABORTED, f"transfer from "
                                      f"{tr.peer.node_id} aborted: no progress for "
                                      f"{self._timeout:g}s")
        except (StatusError, TransportError) as exc:
            await self._abort(tr, tasks, messages, firsts, done_msgs, exc)
            return
        self.counters.num_transfers += 1
        if bad:
            self._refetch(tr, bad)

    async def _verify(self, tr: Inbound, positions: range) -> list[int]:
        """Check each block's checksum; publish the good ones; return the bad positions."""
        def sums() -> list[int]:
            out = []
            for p in positions:
                out.append(block_checksum(self.slot_view(tr.slots[p])))
            return out

        nbytes = len(positions) * self.slot_bytes
        got = await asyncio.to_thread(sums) if nbytes >= _THREAD_VERIFY_BYTES else sums()
        self.counters.bytes_in += nbytes
        bad, good = [], []
        for p, checksum in zip(positions, got, strict=True):
            if checksum != tr.checksums[p]:
                bad.append(p)
                continue
            if self.pool.arrived(tr.slots[p], checksum):
                good.append(tr.hashes[p])
            self._resolve(tr.hashes[p], None)
        self._sync.added(good)
        self.counters.num_checksum_failures += len(bad)
        return bad

    def _refetch(self, tr: Inbound, bad: list[int]) -> None:
        if tr.attempt > 0:
            self._fail(tr, bad, StatusError(
                grpc.StatusCode.DATA_LOSS, f"block checksum mismatch twice from "
                f"{tr.peer.node_id}: {', '.join(tr.hashes[p].hex()[:16] for p in bad[:4])}"))
            return
        self.counters.num_refetches += len(bad)
        again = Inbound(secrets.randbits(64), tr.peer, [tr.hashes[p] for p in bad],
                        [tr.slots[p] for p in bad], [tr.checksums[p] for p in bad], attempt=1)
        self._spawn(self._pull(again))

    async def _abort(self, tr: Inbound, tasks: list[asyncio.Task[int]],
                     messages: list[Message], firsts: list[int], done_msgs: set[int],
                     exc: Exception) -> None:
        self.counters.num_errors += 1
        self._transport.drop(tr.peer.node_id)  # cancels the receives still posted
        await asyncio.wait(tasks, timeout=1.0)
        err = exc if isinstance(exc, StatusError) else StatusError(
            grpc.StatusCode.ABORTED, f"transfer from {tr.peer.node_id} failed: {exc}")
        for i, task in enumerate(tasks):
            if i in done_msgs:
                continue
            positions = range(firsts[i], firsts[i + 1])
            if task.done():
                self._fail(tr, positions, err)
            else:  # UCX never gave the buffer back: leave the slots IN_FLIGHT rather than reuse
                log.error("receive not cancelled; slots quarantined",
                          extra={"fields": {"slots": [tr.slots[p] for p in positions]}})
                for p in positions:
                    self._resolve(tr.hashes[p], err)

    def _fail(self, tr: Inbound, positions: Sequence[int], err: StatusError) -> None:
        for p in positions:
            self.pool.abandon(tr.slots[p])
            self._resolve(tr.hashes[p], err)

    def _resolve(self, h: bytes, err: StatusError | None) -> None:
        fut = self.inbound.pop(h, None)
        if fut is not None and not fut.done():
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)
