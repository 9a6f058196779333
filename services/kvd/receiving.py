"""The receiving half of shipping: take a peer's push or pull from a source, post the UCX
receives (or copy straight from the peer's pool on the same host, ``samehost``), verify every
block's checksum, refetch bad ones once (on the same host: copy them again), and abort a
transfer whose peer is lost, restarted or stalled (the life cycle is in ``shipping``)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from pdserve.errors import StatusError
from pdserve.hashing import block_checksum
from pdserve.proto.v1 import common_pb2, kvd_pb2
from services.kvd import metrics
from services.kvd.link import RPC_TIMEOUT_S, Half, Link
from services.kvd.samehost import PeerPool
from services.kvd.transfer import Message, TransportError

log = logging.getLogger(__name__)

_PULL = kvd_pb2.TransferRequest.DIRECTION_PULL
# Verify a message on the loop as it lands, still in cache (8 MiB: under 1 ms; a thread hop
# per message cost more than it saved here); only larger ones in a thread (xxhash frees the GIL).
_THREAD_VERIFY_BYTES = 16 << 20


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


class Receiver(Half):
    """Inbound transfers of one kvd: ``inbound`` maps each hash in flight here to its future."""

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self._sync = link.sync
        self.slot_view = link.slot_view
        self.inbound: dict[bytes, asyncio.Future[None]] = {}
        self._same_host = link.same_host

    async def serve_push(self, req: kvd_pb2.TransferRequest) -> kvd_pb2.TransferResponse:
        """A peer announces blocks: reserve slots for those new here and post the receives."""
        peer = self._same_host.open(req.shm_name, req.shm_token) \
            if self._same_host is not None else None
        if req.same_host_only and peer is None:  # the sender pushes over UCX once it checked
            return kvd_pb2.TransferResponse(accepted=[False] * len(req.blocks),
                                            ucx_address=self._transport.address)
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
        sums: list[int] = []
        if refs and peer is not None:
            # Shielded: the copy and its outcome (publish, or free the slots and fail the
            # waiters) must finish even when the sender dies and gRPC cancels this handler.
            copy = asyncio.ensure_future(self._copy_same_host(tr, peer, src))
            copy.add_done_callback(lambda f: f.cancelled() or f.exception())
            got = iter(await asyncio.shield(copy))
            sums = [next(got) if ok else 0 for ok in accepted]
        elif refs:
            try:
                ep = await self._transport.endpoint(req.peer.node_id, req.ucx_address)
            except TransportError as exc:
                err = StatusError(grpc.StatusCode.UNAVAILABLE, str(exc))
                self._fail(tr, range(len(refs)), err)
                raise err from exc
            self._spawn(self._receive(tr, ep, self._transport.plan(src, slots)))
        return kvd_pb2.TransferResponse(accepted=accepted, ucx_address=self._transport.address,
                                        slots=slots, codec=tr.codec, checksums=sums,
                                        same_host=peer is not None)

    async def _copy_same_host(self, tr: Inbound, peer: PeerPool, src: list[int]) -> list[int]:
        """Copy the peer's slots ``src`` into ours (``samehost``) and check each block against
        its announced (the writer's) checksum; copy the mismatched ones once more, then publish
        the good blocks and fail the others with DATA_LOSS. ABORTED (slots freed, waiters
        failed) if the peer died meanwhile. Returns the checksum of each block as copied."""
        assert self._same_host is not None
        positions = range(len(tr.hashes))
        with metrics.transfer(self._me.node_id, "in", tr.peer.node_id, len(tr.hashes),
                              len(tr.hashes) * self.slot_bytes):
            try:
                got = await self._same_host.copy(peer, src, tr.slots)
                bad = [p for p in positions if got[p] != tr.checksums[p]]
                if bad:  # a refetch from the same pool: no UCX, and no race with its publish
                    self.counters.num_checksum_failures += len(bad)
                    self.counters.num_refetches += len(bad)
                    again = await self._same_host.copy(peer, [src[p] for p in bad],
                                                       [tr.slots[p] for p in bad])
                    for p, checksum in zip(bad, again, strict=True):
                        got[p] = checksum
            except ValueError as exc:
                err = StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                self._fail(tr, positions, err)
                raise err from exc
            if self._same_host.faults.delay_ms:
                await asyncio.sleep(self._same_host.faults.delay_ms / 1000)
            if not peer.alive():
                self.counters.num_errors += 1
                err = StatusError(grpc.StatusCode.ABORTED, f"transfer from {tr.peer.node_id} "
                                  "aborted: the peer died during a same-host read (pool "
                                  f"{peer.name}); its blocks were not taken")
                self._fail(tr, positions, err)
                raise err
            bad = self._publish(tr, positions, got)
        self.counters.num_transfers += 1
        self.counters.num_same_host += 1
        if bad:
            self._fail(tr, bad, self._mismatch_twice(tr, bad))
        return got

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
            resp = await self._peers.transfer(tr.peer.address, req, RPC_TIMEOUT_S)
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
            return [block_checksum(self.slot_view(tr.slots[p])) for p in positions]

        nbytes = len(positions) * self.slot_bytes
        got = await asyncio.to_thread(sums) if nbytes >= _THREAD_VERIFY_BYTES else sums()
        return self._publish(tr, positions, got)

    def _publish(self, tr: Inbound, positions: range, got: list[int]) -> list[int]:
        """Publish the blocks whose checksum ``got`` matches the announced one; return the
        positions of the others."""
        self.counters.bytes_in += len(positions) * self.slot_bytes
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
            self._fail(tr, bad, self._mismatch_twice(tr, bad))
            return
        self.counters.num_refetches += len(bad)
        again = Inbound(secrets.randbits(64), tr.peer, [tr.hashes[p] for p in bad],
                        [tr.slots[p] for p in bad], [tr.checksums[p] for p in bad], attempt=1)
        self._spawn(self._pull(again))

    @staticmethod
    def _mismatch_twice(tr: Inbound, bad: list[int]) -> StatusError:
        return StatusError(grpc.StatusCode.DATA_LOSS, f"block checksum mismatch twice from "
                           f"{tr.peer.node_id}: "
                           f"{', '.join(tr.hashes[p].hex()[:16] for p in bad[:4])}")

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
