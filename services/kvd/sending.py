"""The sending half of shipping: announce a push, answer a peer's pull, send the messages
over UCX and release the pins (the life cycle is in ``shipping``)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pdserve.errors import StatusError
from pdserve.proto.v1 import common_pb2, kvd_pb2
from services.kvd import metrics
from services.kvd.link import RPC_TIMEOUT_S, Half, Link
from services.kvd.pool import PinRecord
from services.kvd.transfer import Message, TransportError
from services.kvd.wirecodec import WireCodec

log = logging.getLogger(__name__)

_PUSH = kvd_pb2.TransferRequest.DIRECTION_PUSH


@dataclass(frozen=True)
class CheckedPush:
    """A same-host push of blocks not yet published here (``Sender.push_written``)."""

    num_pushed: int | None  # None: the receiver could not be reached
    verified: list[bool]  # per block: the receiver's copy matched the writer's checksum


class Sender(Half):
    """Push and serve-pull of one kvd's blocks."""

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self._release = link.release
        self._elsewhere: set[str] = set()  # peers that answered "not on this host"

    async def push_written(self, dest: common_pb2.KvdEndpoint,
                           entries: Sequence[kvd_pb2.CommitEntry]) -> CheckedPush | None:
        """Push a Commit's written, not yet published blocks (their writer's pins hold the
        slots) to a receiver on this host, which copies them from our pool and checks each
        against the writer's checksum while it is in cache: its check stands for ours, so
        Commit need not read the blocks again. None if ``dest`` is not on this host (or this
        pool is not offered): the caller checks the blocks, publishes them and pushes over UCX.
        A hash repeated in the batch goes once; its later entries count as not verified."""
        name, token = self.link.segment
        if not name or dest.node_id in self._elsewhere:
            return None
        first: dict[bytes, int] = {}
        for i, e in enumerate(entries):
            first.setdefault(e.hash, i)
        sent = list(first.values())
        refs = [common_pb2.BlockRef(hash=entries[i].hash, checksum=entries[i].checksum)
                for i in sent]
        req = kvd_pb2.TransferRequest(direction=_PUSH, peer=self._me, blocks=refs,
                                      ucx_address=self._transport.address,
                                      transfer_id=secrets.randbits(64),
                                      slots=[entries[i].slot for i in sent],
                                      slot_bytes=self.slot_bytes, kv_dtype=self.kv_dtype,
                                      shm_name=name, shm_token=token, same_host_only=True)
        start, start_ns = time.perf_counter(), time.time_ns()
        try:
            resp = await self._peers.transfer(dest.address, req, RPC_TIMEOUT_S + self._timeout)
        except grpc.RpcError as exc:
            log.warning("push announce failed", extra={"fields": {"dest": dest.address,
                                                                  "error": str(exc)}})
            self.counters.num_errors += 1
            return CheckedPush(None, [False] * len(entries))
        if not resp.same_host:
            self._elsewhere.add(dest.node_id)
            return None
        verified = [False] * len(entries)
        for i, ok, got, ref in zip(sent, resp.accepted, resp.checksums, refs, strict=False):
            verified[i] = ok and got == ref.checksum
        num = sum(resp.accepted)
        if num:  # as a UCX push: only a transfer that moved blocks counts
            metrics.sent_same_host(self._me.node_id, dest.node_id, num, num * self.slot_bytes,
                                   start, start_ns)
            self.counters.bytes_out += num * self.slot_bytes
            self.counters.num_transfers += 1
            self.counters.num_same_host += 1
        return CheckedPush(num, verified)

    def _pin_for_transfer(self, slot: int) -> PinRecord:
        h = self.pool.slots[slot].hash
        pin = self.pool.pin_present(h, "kvd:transfer", 2 * self._timeout + RPC_TIMEOUT_S)
        assert pin is not None
        return pin

    async def push(self, dest: common_pb2.KvdEndpoint, slots: Sequence[int]) -> int | None:
        """Announce ``slots``' blocks to ``dest`` and start sending; None if unreachable."""
        pins = [self._pin_for_transfer(s) for s in slots]
        refs = [common_pb2.BlockRef(hash=self.pool.slots[s].hash,
                                    checksum=self.pool.slots[s].checksum) for s in slots]
        tid = secrets.randbits(64)
        req = kvd_pb2.TransferRequest(direction=_PUSH, peer=self._me, blocks=refs,
                                      ucx_address=self._transport.address, transfer_id=tid,
                                      slots=list(slots), slot_bytes=self.slot_bytes,
                                      kv_dtype=self.kv_dtype, codec=self._offer,
                                      shm_name=self.link.segment[0],
                                      shm_token=self.link.segment[1])
        # A same-host receiver copies before it answers: it may take the transfer's time.
        timeout = RPC_TIMEOUT_S + (self._timeout if req.shm_name else 0)
        start, start_ns = time.perf_counter(), time.time_ns()
        try:
            resp = await self._peers.transfer(dest.address, req, timeout)
        except grpc.RpcError as exc:
            log.warning("push announce failed", extra={"fields": {"dest": dest.address,
                                                                  "error": str(exc)}})
            self.counters.num_errors += 1
            self._release(pins)
            return None
        sent = [p for p, ok in zip(pins, resp.accepted, strict=False) if ok]
        self._release([p for p, ok in zip(pins, resp.accepted, strict=False) if not ok])
        if sent and resp.same_host:  # the receiver copied them from our pool already
            self._release(sent)
            metrics.sent_same_host(self._me.node_id, dest.node_id, len(sent),
                                   len(sent) * self.slot_bytes, start, start_ns)
            self.counters.bytes_out += len(sent) * self.slot_bytes
            self.counters.num_transfers += 1
            self.counters.num_same_host += 1
        elif sent:
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

