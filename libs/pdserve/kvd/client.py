"""Engine-side client of the node's kvd: maps the pool segment, exposes slots as tensors without
copying, and wraps the control calls (grpc.aio). Used by prefill and decode.

Export (prefill)::

    client = KvdClient("127.0.0.1:50081", client_id="prefill-0")
    await client.register(BlockLayout(num_layers, block_size, kv_heads, head_dim, "bfloat16"))
    pins = await client.allocate(len(blocks))
    for pin, block in zip(pins, blocks):
        sums.append(client.write_block(pin.slot, block)) # [layers, 2, bs, kvh, hd]; xxh3 hot
    await client.commit([CommitEntry(p, h, s) for p, h, s in zip(pins, hashes, sums)],
                        destination=decode_kvd)

Import (decode)::

    pins = await client.await_blocks(block_refs, source=prefill_kvd, timeout=5.0)
    for pin in pins:
        paged_cache.scatter(client.slot_view(pin.slot))   # read while pinned
    await client.release([p.pin_id for p in pins])

Allocate, Commit, Await and Release travel on the kvd's Unix control socket when its Register
names one this process can reach (``local_control``), else on one gRPC stream held open to the
kvd (``control_stream=False``: unary calls), with the same semantics and errors either way.

A slot's bytes may be read or written only while its pin is held: kvd never reuses a pinned
slot, and a pin expires with its lease (``lease_ms``; the kvd default if 0). Failures are
``grpc.RpcError`` with the status code and a message naming the field; bad local arguments
are ``ValueError``.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import grpc
import torch

from pdserve.auth import DATA
from pdserve.channel import insecure_channel
from pdserve.hashing import block_checksum
from pdserve.kvd import layout as L
from pdserve.kvd.control import ControlStream, LocalControl
from pdserve.proto.v1 import common_pb2, kvd_pb2, kvd_pb2_grpc
from pdserve.telemetry import outbound_metadata

log = logging.getLogger(__name__)

_UNARY = {"allocate": "Allocate", "commit": "Commit", "wait": "Await", "release": "Release"}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Pin:
    slot: int
    pin_id: int


@dataclass(frozen=True)
class CommitEntry:
    """A written slot to publish as block ``hash``; ``checksum`` None = computed here (xxh3)."""

    pin: Pin
    hash: bytes
    checksum: int | None = None


@dataclass(frozen=True)
class CommitResult:
    num_duplicates: int
    num_pushed: int
    push_started: bool
    slots: tuple[int, ...]


@dataclass(frozen=True)
class PoolInfo:
    shm_name: str
    slot_bytes: int
    num_slots: int
    node_id: str
    epoch: int
    data_offset: int
    max_batch_blocks: int
    control_socket: str = ""  # the kvd's Unix control socket, if it serves one


def _pins(pb: Sequence[kvd_pb2.Pin]) -> list[Pin]:
    return [Pin(p.slot, p.pin_id) for p in pb]


class KvdClient:
    def __init__(self, address: str, client_id: str, secret: str = "",
                 rpc_timeout: float = 10.0, control_stream: bool = True,
                 local_control: bool = True) -> None:
        if not address:
            raise ValueError("address: the kvd gRPC address host:port must not be empty")
        self.client_id = client_id
        self._channel = insecure_channel(address)
        self._stub = kvd_pb2_grpc.KvdStub(self._channel)
        self._md = ((DATA.key, secret),) if secret else ()
        self._timeout = rpc_timeout
        self._shm: shared_memory.SharedMemory | None = None
        self.layout: L.BlockLayout | None = None
        self.info: PoolInfo | None = None
        # Allocate/Commit/Await/Release over one held stream (``control``), else unary calls
        self._control = ControlStream(self._stub, self._metadata) if control_stream else None
        self._secret, self._use_local = secret, local_control
        self._local: LocalControl | None = None  # the kvd's control socket, once registered

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """The credential, and the current span's trace context (the kvd's spans are its
        children)."""
        return outbound_metadata(self._md)

    async def register(self, layout: L.BlockLayout) -> PoolInfo:
        """Announce the block layout and map the pool segment."""
        req = kvd_pb2.RegisterRequest(client_id=self.client_id, layout=kvd_pb2.BlockLayout(
            num_layers=layout.num_layers, block_size=layout.block_size,
            num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
            model_fingerprint=layout.model_fingerprint))
        r = await self._stub.Register(req, timeout=self._timeout, metadata=self._metadata())
        shm = shared_memory.SharedMemory(r.shm_name)
        # Python < 3.13 tracks attached segments too and would unlink kvd's pool at our exit.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        assert shm.buf is not None
        slot_bytes, num_slots, _ = L.read_header(shm.buf)
        if (slot_bytes, num_slots) != (r.slot_bytes, r.num_slots):
            raise ValueError(f"shm {r.shm_name}: header says {num_slots} x {slot_bytes} bytes, "
                             f"kvd said {r.num_slots} x {r.slot_bytes}")
        # Map every page now (a read per page): first touches in this process are minor faults,
        # which made a 64 MiB write-then-commit several ms slower on every fresh slot.
        torch.frombuffer(shm.buf, dtype=torch.uint8)[::mmap.PAGESIZE].max()
        self._unmap()  # registering again (a restarted kvd): the old pool is not its any more
        self._shm, self.layout = shm, layout
        self.info = PoolInfo(r.shm_name, r.slot_bytes, r.num_slots, r.node_id, r.epoch,
                             r.data_offset, r.max_batch_blocks, r.control_socket)
        await self._connect_local(r.control_socket)
        return self.info

    async def _connect_local(self, path: str) -> None:
        """Use the kvd's control socket from now on, if it names one that is reachable from
        here (a container that shares the pool but not the socket keeps the gRPC way)."""
        if self._local is not None:
            await self._local.close()
            self._local = None
        if not (path and self._use_local):
            return
        local = LocalControl(path, self._secret)
        try:
            await local.open()
        except (OSError, grpc.aio.AioRpcError) as exc:
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise  # refused: the kvd's answer, as its gRPC calls would give it
            log.info("kvd control socket not reachable; using the Control rpc",
                     extra={"fields": {"path": path, "error": str(exc)}})
            return
        self._local = local

    @property
    def control_carrier(self) -> str:
        """How the per-transfer calls travel: ``socket``, ``stream`` or ``unary``."""
        if self._local is not None:
            return "socket"
        return "stream" if self._control is not None else "unary"

    def _mapped(self, slot: int) -> tuple[shared_memory.SharedMemory, PoolInfo, int]:
        if self._shm is None or self.info is None:
            raise ValueError("slot: register() first; the pool is not mapped")
        if not 0 <= slot < self.info.num_slots:
            raise ValueError(f"slot: slot {slot} out of range 0..{self.info.num_slots - 1}")
        return self._shm, self.info, self.info.data_offset + slot * self.info.slot_bytes

    def slot_view(self, slot: int) -> torch.Tensor:
        """The slot as a ``[layers, 2, block_size, kv_heads, head_dim]`` tensor, or for a
        quantized layout its ``[slot_bytes]`` bytes (values, then scales) (no copy)."""
        shm, info, offset = self._mapped(slot)
        assert self.layout is not None
        if self.layout.is_quantized:
            return torch.frombuffer(shm.buf, dtype=torch.uint8, count=info.slot_bytes,
                                    offset=offset)
        dtype = _TORCH_DTYPES[self.layout.dtype]
        n = info.slot_bytes // L.DTYPE_BYTES[self.layout.dtype]
        flat = torch.frombuffer(shm.buf, dtype=dtype, count=n, offset=offset)
        return flat.view(self.layout.shape)

    @property
    def mapped(self) -> memoryview:
        """The whole mapped pool segment (an engine on CUDA registers it as pinned memory)."""
        if self._shm is None or self._shm.buf is None:
            raise ValueError("mapped: register() first; the pool is not mapped")
        return self._shm.buf

    def write_block(self, slot: int, block: torch.Tensor) -> int:
        """Copy ``block`` (``slot_view``'s shape and dtype) into the slot; the xxh3 of the
        slot's bytes, taken right after the copy while they are still in cache (what a
        ``CommitEntry`` carries: a second pass later reads them back from memory)."""
        self.slot_view(slot).copy_(block)
        return block_checksum(self.slot_memory(slot))

    def slot_memory(self, slot: int) -> memoryview:
        """The slot's raw bytes (for checksums and byte-level copies)."""
        shm, info, offset = self._mapped(slot)
        assert shm.buf is not None
        return shm.buf[offset:offset + info.slot_bytes]

    async def allocate(self, n: int, lease_ms: int = 0) -> list[Pin]:
        req = kvd_pb2.AllocateRequest(num_slots=n, lease_ms=lease_ms, client_id=self.client_id)
        return _pins((await self._rpc("allocate", req, self._timeout)).pins)

    async def _rpc(self, field: str, req: Any, timeout: float) -> Any:
        """One of the engine's per-transfer calls: on the control socket or stream, or unary."""
        if self._local is not None:
            return await self._local.call(field, req, timeout)
        if self._control is not None:
            return await self._control.call(field, req, timeout)
        method = getattr(self._stub, _UNARY[field])
        return await method(req, timeout=timeout, metadata=self._metadata())

    async def commit(self, entries: Sequence[CommitEntry],
                     destination: common_pb2.KvdEndpoint | None = None,
                     release: bool = True) -> CommitResult:
        """Publish written slots; with ``destination``, push them there at once."""
        pb = []
        for e in entries:
            checksum = e.checksum
            if checksum is None:
                checksum = block_checksum(self.slot_memory(e.pin.slot))
            pb.append(kvd_pb2.CommitEntry(slot=e.pin.slot, hash=e.hash, checksum=checksum,
                                          pin_id=e.pin.pin_id))
        req = kvd_pb2.CommitRequest(entries=pb, destination=destination, release=release,
                                    client_id=self.client_id)
        r = await self._rpc("commit", req, self._timeout)
        return CommitResult(r.num_duplicates, r.num_pushed, r.push_started, tuple(r.slots))

    async def lookup(self, hashes: Sequence[bytes]) -> int:
        """Length of the leading run of ``hashes`` present in this node's pool."""
        return (await self.lookup_cluster(hashes, include_index=False))[0]

    async def lookup_cluster(self, hashes: Sequence[bytes],
                             include_index: bool = True) -> tuple[int, int]:
        """(leading run here, leading run here or on one other node per the index): an
        ``await_blocks`` without a source pulls the difference from that node."""
        r = await self._stub.Lookup(kvd_pb2.LookupRequest(hashes=hashes,
                                                          include_index=include_index),
                                    timeout=self._timeout, metadata=self._metadata())
        return int(r.num_present), int(r.num_available or r.num_present)

    async def await_blocks(self, block_refs: Sequence[common_pb2.BlockRef],
                           source: common_pb2.KvdEndpoint | None = None,
                           timeout: float = 30.0, lease_ms: int = 0) -> list[Pin]:
        """Pins of ``block_refs``' slots once all are present here (the call's deadline is
        ``timeout``)."""
        req = kvd_pb2.AwaitRequest(blocks=block_refs, source=source, lease_ms=lease_ms,
                                   client_id=self.client_id)
        return _pins((await self._rpc("wait", req, timeout)).pins)

    async def release(self, pin_ids: Sequence[int]) -> int:
        req = kvd_pb2.ReleaseRequest(pin_ids=pin_ids, client_id=self.client_id)
        return int((await self._rpc("release", req, self._timeout)).num_released)

    async def stats(self) -> kvd_pb2.KvdStats:
        return await self._stub.Stats(kvd_pb2.KvdStatsRequest(), timeout=self._timeout,
                                      metadata=self._metadata())

    def session(self) -> AsyncIterator[kvd_pb2.SessionResponse]:
        """This client's presence at the kvd, held open (no deadline) while it lives: the
        kvd's epoch first; the stream ends (an ``AioRpcError``) when the kvd goes away, and the
        kvd releases this client's pins when this process does."""
        call = self._stub.Session(kvd_pb2.SessionRequest(client_id=self.client_id),
                                  metadata=self._metadata())
        return call.__aiter__()  # type: ignore[no-any-return]

    async def close(self) -> None:
        """Close the channel and unmap the segment (kept mapped while tensor views live)."""
        if self._local is not None:
            await self._local.close()
        if self._control is not None:
            await self._control.close()
        await self._channel.close()
        self._unmap()

    def _unmap(self) -> None:
        if self._shm is not None:
            # A live slot_view keeps the mapping; it then goes with the process.
            with contextlib.suppress(BufferError):
                self._shm.close()
            self._shm = None
