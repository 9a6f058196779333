"""The kvd core: the shared-memory pool, its control operations, and the Await entry.

An engine registers its block layout (fixing the slot size), allocates slots, writes blocks
into the mapped segment, and commits them under their hashes, optionally naming a destination
kvd so they are pushed at once (``shipping`` has the transfer life cycle). On the other node
an engine awaits the hashes: present ones are pinned, in-flight ones waited for, the rest
pulled from the given or indexed source; on any failure every pin the Await took is released.
``awaiting`` has that wait, ``peering`` the registry of peers this kvd deals with.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import secrets
import time
from collections.abc import Sequence
from multiprocessing import shared_memory

import grpc
import numpy as np

from pdserve import auth
from pdserve.errors import BadRequest, StatusError
from pdserve.hashing import HASH_LEN, block_checksum
from pdserve.index import IndexUnavailable, NodeRecord, PrefixIndex
from pdserve.kvd import layout as L
from pdserve.proto.v1 import common_pb2, kvd_pb2
from services.kvd import awaiting, peering, samehost, segments, wirecodec
from services.kvd.config import KvdConfig
from services.kvd.index_sync import IndexSync
from services.kvd.link import Link
from services.kvd.peers import Peers
from services.kvd.pool import PinRecord, Pool, SlotState
from services.kvd.shipping import Shipper
from services.kvd.transfer import Faults, UcxTransport

log = logging.getLogger(__name__)


class Kvd:
    def __init__(self, config: KvdConfig, index: PrefixIndex | None, net_devices: str) -> None:
        self.config = config
        self.me = common_pb2.KvdEndpoint()  # known once the port is bound: ``start``
        self.epoch = int(time.time() * 1000)  # increases across restarts without shared state
        self._index = index
        self.transport = UcxTransport(
            config.ucx_tls, net_devices, config.max_message_kib * 1024,
            Faults(config.fault_corrupt_every, config.fault_send_delay_ms),
            config.ucx_error_handling)
        self.peers = Peers(auth.secrets().get(auth.DATA.name, ""))
        self.gate = peering.PeerGate(index, self.peers, config.peers)
        self.sync = IndexSync(index, self._record, self._present, config.heartbeat,
                              config.index_ttl, self.gate.learn_nodes)
        self.layout: L.BlockLayout | None = None
        self.codec = wirecodec.make(config.wire_codec)  # opt-in (--wire-codec)
        self.shipper: Shipper | None = None
        self._shm: shared_memory.SharedMemory | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._sessions: dict[str, int] = {}  # client_id -> open Session streams
        self.control_socket = ""  # the Unix socket serving Control messages, once it listens

    # -- life --------------------------------------------------------------------------------
    async def start(self, me: common_pb2.KvdEndpoint) -> None:
        self.me = self.gate.me = me
        self.transport.start()
        self.sync.start()
        self._lease_task = asyncio.get_running_loop().create_task(self._expire_leases())

    async def stop(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
        if self.shipper is not None:
            await self.shipper.stop()
        await self.transport.stop()
        await self.sync.stop()
        await self.peers.close()
        if self._shm is not None:
            segments.remove(self._shm)
            self._shm = None

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            if self.shipper is not None:
                self.shipper.pool.expire()

    # -- sessions ------------------------------------------------------------------------------
    def open_session(self, client_id: str) -> None:
        self._sessions[client_id] = self._sessions.get(client_id, 0) + 1

    def close_session(self, client_id: str) -> int:
        """The client's stream ended: once its last one has, release every pin it holds (a
        dead engine's pins go now, not when their leases pass). Returns how many."""
        left = self._sessions.get(client_id, 1) - 1
        if left > 0:
            self._sessions[client_id] = left
            return 0
        self._sessions.pop(client_id, None)
        if self.shipper is None:
            return 0
        released = self.shipper.pool.release_client(client_id)
        if released:
            log.info("client gone: its pins released",
                     extra={"fields": {"client_id": client_id, "num_pins": released}})
        return released

    def _record(self) -> NodeRecord:
        pool = self.shipper.pool if self.shipper else None
        return NodeRecord(self.me.node_id, self.me.address, self.transport.address,
                          pool.num_slots if pool else 0, self.epoch,
                          self.shipper.slot_bytes if self.shipper else 0)

    def _present(self) -> list[bytes]:
        return list(self.shipper.pool.by_hash) if self.shipper else []

    # -- control -----------------------------------------------------------------------------
    def register(self, layout: L.BlockLayout) -> kvd_pb2.RegisterResponse:
        """Fix the slot size on the first registration; later ones must match it."""
        if self.layout is None:
            self._create_pool(layout)
        elif layout.is_quantized != self.layout.is_quantized or (
                layout.is_quantized and layout.dtype != self.layout.dtype):
            raise BadRequest(f"layout.dtype: KV cache dtype {layout.dtype}, but this pool "
                             f"holds {self.layout.dtype} blocks (first registered layout); "
                             "quantized and unquantized KV caches never share blocks")
        elif layout.block_bytes != self.layout.block_bytes:
            raise BadRequest(f"layout: blocks of {layout.block_bytes} bytes, but this pool's slots "
                             f"hold {self.layout.block_bytes} (first registered layout)")
        assert self._shm is not None and self.shipper is not None
        return kvd_pb2.RegisterResponse(
            shm_name=self._shm.name, slot_bytes=self.shipper.slot_bytes,
            num_slots=self.shipper.pool.num_slots, node_id=self.me.node_id, epoch=self.epoch,
            data_offset=L.HEADER_BYTES, max_batch_blocks=self.config.max_batch_blocks,
            control_socket=self.control_socket)

    def _create_pool(self, layout: L.BlockLayout) -> None:
        slot_bytes = layout.block_bytes
        num_slots = self.config.capacity_mib * 1024 * 1024 // slot_bytes
        if num_slots < 1:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"layout: one block ({slot_bytes} bytes) exceeds --capacity-mib "
                              f"{self.config.capacity_mib}")
        segments.unlink_stale()  # what a killed kvd of this host left behind
        self._shm = segments.create(
            segments.segment_name(self.me.node_id, os.getpid(), self.epoch),
            L.segment_bytes(slot_bytes, num_slots))
        assert self._shm.buf is not None
        token = secrets.token_bytes(L.TOKEN_BYTES)
        L.write_header(self._shm.buf, slot_bytes, num_slots, self.epoch, token)
        arr = np.ndarray((self._shm.size,), dtype=np.uint8, buffer=self._shm.buf)
        # Fault every page in now: a first write into a fresh shm page costs a page fault, and
        # a transfer landing in never-used slots ran at a third of the speed of one landing in
        # used slots (64 MiB: 16k faults). The memory is the pool's anyway.
        arr[L.HEADER_BYTES::mmap.PAGESIZE] = 0  # (past the header, written above)
        self.transport.attach(arr, L.HEADER_BYTES, slot_bytes)
        self.layout = layout
        self.shipper = Shipper(Link(Pool(num_slots, self.epoch), arr, L.HEADER_BYTES,
                                    slot_bytes, self.transport, self.peers, self.sync, self.me,
                                    self.config.transfer_timeout, layout.dtype, self.codec,
                                    *samehost.make(self.config, arr, slot_bytes,
                                                   self._shm.name, token)))
        log.info("pool created", extra={"fields": {"shm": self._shm.name, "slots": num_slots,
                                                    "slot_bytes": slot_bytes}})

    def _ship(self) -> Shipper:
        if self.shipper is None:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              "no block layout registered yet: an engine must call Register first")
        return self.shipper

    def _check_batch(self, n: int, field: str) -> None:
        if n > self.config.max_batch_blocks:
            raise BadRequest(f"{field}: {n} items, more than --max-batch-blocks "
                             f"{self.config.max_batch_blocks}")

    @staticmethod
    def _check_hash(h: bytes, field: str) -> None:
        if len(h) != HASH_LEN:
            raise BadRequest(f"{field}: a block hash is {HASH_LEN} bytes, got {len(h)}")

    def _lease(self, lease_ms: int) -> float:
        """The lease of a new pin: asked for (capped at --max-lease-ms) or the default."""
        return min(lease_ms or self.config.lease_ms, self.config.max_lease_ms) / 1000

    def _quota(self, pool: Pool) -> int:
        return max(1, int(pool.num_slots * self.config.max_client_share))

    def allocate(self, n: int, lease_ms: int, client_id: str) -> list[PinRecord]:
        ship = self._ship()
        if n < 1:
            raise BadRequest(f"num_slots: must be >= 1, got {n}")
        self._check_batch(n, "num_slots")
        ship.pool.check_quota(client_id, n, self._quota(ship.pool))
        pins = ship.pool.allocate(n, client_id, self._lease(lease_ms))
        self._flush_evictions()
        return pins

    def _flush_evictions(self) -> None:
        pool = self._ship().pool
        self.sync.removed(pool.counters.evicted)
        pool.counters.evicted = []

    async def commit(self, entries: Sequence[kvd_pb2.CommitEntry],
                     destination: common_pb2.KvdEndpoint | None, release: bool,
                     client_id: str) -> kvd_pb2.CommitResponse:
        """Publish the caller's written slots. The writer's checksum is required and must
        match the slot: kvd never vouches for bytes it did not see written. With a destination
        on this host the receiver's check of its copy (``Shipper.push_written``) stands for
        this kvd's own pass over the blocks; only the blocks it did not take are read here."""
        ship = self._ship()
        pool = ship.pool
        self._check_batch(len(entries), "entries")
        for i, e in enumerate(entries):  # validate everything before changing anything
            self._check_hash(e.hash, f"entries[{i}].hash")
            s = pool.check_slot(e.slot, f"entries[{i}].slot")
            pin = pool.own_pin(e.pin_id, client_id)
            if pin is None or pin.slot != e.slot or s.state != SlotState.WRITING:
                raise BadRequest(f"entries[{i}].pin_id: {e.pin_id} is not a live Allocate pin on "
                                 f"slot {e.slot}")
            if not e.checksum:
                raise BadRequest(f"entries[{i}].checksum: required: the writer's xxh3-64 of the "
                                 "slot's block bytes")
        if len({e.slot for e in entries}) != len(entries):
            raise BadRequest("entries: a slot appears twice")
        dest = destination if destination is not None and destination.address else None
        if dest is not None:
            await self.gate.check(dest, "destination")
        checked = await ship.push_written(dest, entries) if dest is not None else None
        for i, e in enumerate(entries):
            if checked is not None and checked.verified[i]:
                continue
            if block_checksum(ship.slot_view(e.slot)) != e.checksum:
                raise BadRequest(f"entries[{i}].checksum: does not match the bytes of slot "
                                 f"{e.slot} (not written, or written after the checksum)")
        slots, new = [], []
        for i, e in enumerate(entries):
            slot = pool.commit(e.slot, e.pin_id, e.hash, e.checksum, f"entries[{i}]")
            if slot == e.slot:
                new.append(e.hash)
            slots.append(slot)
            if release:
                pool.release(e.pin_id)
        self.sync.added(new)
        resp = kvd_pb2.CommitResponse(num_duplicates=len(entries) - len(new), slots=slots)
        if dest is not None:
            pushed = checked.num_pushed if checked is not None else \
                await ship.push(dest, list(dict.fromkeys(slots)))
            resp.push_started, resp.num_pushed = pushed is not None, pushed or 0
        return resp

    async def lookup(self, hashes: Sequence[bytes], include_index: bool) -> tuple[int, int]:
        """The leading run of ``hashes`` present here, and (with ``include_index``) the
        longest one here or on another node per the index, which Await can pull."""
        self._check_batch(len(hashes), "hashes")
        for i, h in enumerate(hashes):
            self._check_hash(h, f"hashes[{i}]")
        here = self._ship().pool.lookup(hashes)
        if not include_index or self._index is None or here == len(hashes):
            return here, here
        try:
            counts = await self._index.lookup(hashes)
        except IndexUnavailable:
            return here, here  # the index is soft state: no answer is a miss, not an error
        elsewhere = max((c for n, c in counts.items() if n != self.me.node_id), default=0)
        return here, max(here, min(elsewhere, len(hashes)))

    def release(self, pin_ids: Sequence[int], client_id: str) -> int:
        """Drop the caller's own pins; another client's pin is as unknown as a made-up one."""
        ship = self._ship()
        self._check_batch(len(pin_ids), "pin_ids")
        unknown = [p for p in pin_ids if ship.pool.own_pin(p, client_id) is None]
        if unknown:
            raise BadRequest(f"pin_ids: unknown or expired pin {unknown[0]}")
        return sum(ship.pool.release(p) for p in pin_ids)

    # -- await (``awaiting``) ----------------------------------------------------------------------
    async def await_blocks(self, refs: Sequence[common_pb2.BlockRef],
                           source: common_pb2.KvdEndpoint | None, lease_ms: int,
                           client_id: str, timeout: float) -> list[PinRecord]:
        ship = self._ship()
        self._check_batch(len(refs), "blocks")
        for i, r in enumerate(refs):
            self._check_hash(r.hash, f"blocks[{i}].hash")
        ship.pool.check_quota(client_id, len(refs), self._quota(ship.pool))
        return await awaiting.await_blocks(
            ship, refs, source, self._lease(lease_ms), client_id, timeout,
            lambda refs, to_pull, source: awaiting.find_source(self._index, self.gate, refs,
                                                               to_pull, source))

    # -- peers (``peering``) and stats -------------------------------------------------------------
    async def transfer(self, req: kvd_pb2.TransferRequest) -> kvd_pb2.TransferResponse:
        ship = self._ship()
        self._check_batch(len(req.blocks), "blocks")
        for i, r in enumerate(req.blocks):
            self._check_hash(r.hash, f"blocks[{i}].hash")
        peering.check_transfer(req, ship.slot_bytes, self.layout)
        await self.gate.check(req.peer, "peer", req.ucx_address)
        if req.direction == kvd_pb2.TransferRequest.DIRECTION_PUSH:
            out = await ship.serve_push(req)
        elif req.direction == kvd_pb2.TransferRequest.DIRECTION_PULL:
            out = ship.serve_pull(req)
        else:
            raise BadRequest("direction: must be PUSH or PULL")
        out.control_socket = self.control_socket
        return out

    def stats(self) -> kvd_pb2.KvdStats:
        out = kvd_pb2.KvdStats(node_id=self.me.node_id, epoch=self.epoch,
                               index_available=self.sync.available)
        if self.shipper is None:
            return out
        pool, c = self.shipper.pool, self.shipper.counters
        out.num_slots, out.slot_bytes = pool.num_slots, self.shipper.slot_bytes
        out.slots_free, out.slots_pinned = pool.num_free, pool.num_pinned
        out.slots_present = pool.count(SlotState.PRESENT)
        out.slots_in_flight = pool.count(SlotState.IN_FLIGHT)
        out.slots_writing = pool.count(SlotState.WRITING)
        out.bytes_in, out.bytes_out, out.num_transfers = c.bytes_in, c.bytes_out, c.num_transfers
        out.num_errors, out.num_checksum_failures = c.num_errors, c.num_checksum_failures
        out.num_refetches, out.num_same_host = c.num_refetches, c.num_same_host
        out.num_evictions = pool.counters.num_evictions
        out.num_lease_expiries = pool.counters.num_lease_expiries
        return out
