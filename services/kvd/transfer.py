"""The UCX data plane: kvd-to-kvd messages straight between pool segments (ucxx).

Control goes over gRPC (``Transfer``); only block bytes travel here. A transfer is a list of
``Message``s, each a run of blocks contiguous in BOTH pools, so one UCX message moves it from
the sender's slots into the receiver's slots with no staging copy. Both sides compute the same
plan from the two slot lists (``plan_messages``) and tag message ``i`` of transfer ``t`` with
``message_tag(t, i)``; the receiver posts its receives on its endpoint to the sender.

Endpoints are made from worker addresses exchanged over the (authenticated) Transfer RPC and
cached per peer; no sockaddr listener is opened, because ucxx's binds every interface.

Why UCX endpoint error handling is off by default: on one host UCX then keeps its shared-memory
transports (with it on, only TCP qualifies: ~5x slower here). The CMA transport is excluded by
the default ``--ucx-tls ^cma`` because a CMA read from a peer that died aborts the process;
posix/sysv shared memory does not. A lost peer is detected by the caller's watchdog instead
(peer gRPC channel down, or no progress before the transfer deadline), which aborts the
endpoint: that cancels every receive posted on it, so no late write can land in a reused slot.
Between hosts turn error handling on (``--ucx-error-handling``; it costs nothing there, shared
memory being out of reach anyway): without it the abort is a flush that waits for the peer, so
a peer behind a partition stalls this kvd's loop until the link returns (found by the
namespace cluster, ``pdserve_bench.cluster``); with it the endpoint is force-closed at once.

Progress: one poller task spins the worker while transfers are active and resolves every
posted request's future (``_reap``); between transfers the worker is armed and its epoll fd
wakes the loop (ucxx's own blocking mode never re-arms: it spun at 100% CPU forever).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.kvd.ucx_net import endpoint_lanes
from services.kvd.wirecodec import WireCodec

log = logging.getLogger(__name__)


class TransportError(Exception):
    """A UCX send or receive failed or was cancelled (peer lost, endpoint aborted)."""


TAG_INDEX_BITS = 20
MAX_MESSAGES = 1 << TAG_INDEX_BITS


@dataclass(frozen=True)
class Faults:
    """TEST HOOKS ONLY (set by tests through --fault-* flags; never in production).

    corrupt_every: flip one byte of every Nth block this kvd sends (a copy is sent; the pool
    is untouched). send_delay_ms: sleep before sending each transfer's bytes.
    """

    corrupt_every: int = 0
    send_delay_ms: int = 0


@dataclass(frozen=True)
class Message:
    """``num_blocks`` blocks from sender slot ``src_slot`` on to receiver slot ``dst_slot`` on."""

    src_slot: int
    dst_slot: int
    num_blocks: int


def plan_messages(src_slots: Sequence[int], dst_slots: Sequence[int], slot_bytes: int,
                  max_message_bytes: int) -> list[Message]:
    """Cut a transfer into messages: maximal runs contiguous on both sides, capped in size."""
    if len(src_slots) != len(dst_slots):
        raise ValueError("src_slots and dst_slots differ in length")
    cap = max(1, max_message_bytes // slot_bytes)
    out: list[Message] = []
    for s, d in zip(src_slots, dst_slots, strict=True):
        last = out[-1] if out else None
        if (last is not None and last.num_blocks < cap and s == last.src_slot + last.num_blocks
                and d == last.dst_slot + last.num_blocks):
            out[-1] = Message(last.src_slot, last.dst_slot, last.num_blocks + 1)
        else:
            out.append(Message(s, d, 1))
    if len(out) > MAX_MESSAGES:
        raise ValueError(f"a transfer may have at most {MAX_MESSAGES} messages")
    return out


def message_tag(transfer_id: int, index: int) -> int:
    return ((transfer_id & ((1 << (64 - TAG_INDEX_BITS)) - 1)) << TAG_INDEX_BITS) | index


class UcxTransport:
    """One ucxx worker, the pool as a byte array, endpoints per peer, and a busy poller."""

    def __init__(self, tls: str, net_devices: str, max_message_bytes: int, faults: Faults,
                 error_handling: bool = False) -> None:
        self._pool = np.zeros(0, np.uint8)
        self._data_offset = 0
        self._slot_bytes = 1
        self._tls = tls
        self._net_devices = net_devices
        self._max_message_bytes = max_message_bytes
        self._faults = faults
        self._error_handling = error_handling
        self._eps: dict[str, tuple[bytes, Any]] = {}  # node_id -> (worker address, endpoint)
        self._ep_locks: dict[str, asyncio.Lock] = {}
        self._num_active = 0
        self._wake = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        # posted, not yet done: request, its future, and the buffer (kept alive until done)
        self._requests: list[tuple[Any, asyncio.Future[None], Any]] = []
        self._num_sent_blocks = 0
        self.address = b""
        self.lanes: dict[str, list[str]] = {}  # node_id -> UCX's transports to it

    def attach(self, pool: np.ndarray, data_offset: int, slot_bytes: int) -> None:
        """Point the data plane at the pool segment (once its slot size is known)."""
        self._pool, self._data_offset, self._slot_bytes = pool, data_offset, slot_bytes

    def start(self) -> None:
        # UCX reads its configuration at init; these must be set before ucxx is imported.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")
        import ucxx
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        self._array, self._tag, self._tag_mask = Array, Tag, TagMaskFull
        options = {"TLS": self._tls} if self._tls else {}
        if self._net_devices:
            options["NET_DEVICES"] = self._net_devices
        ucxx.init(options=options, progress_mode="blocking")
        self._ucxx = ucxx
        ex = ucxx.exceptions
        self._errors: tuple[type[BaseException], ...] = (ex.UCXError, ex.UCXCanceled,
                                                         ex.UCXCloseError)
        self.address = ucxx.get_worker_address().tobytes()
        loop = asyncio.get_running_loop()
        ctx = ucxx.core._get_ctx()
        ctx.continuous_ucx_progress(loop)
        self._worker = ctx.worker
        # ucxx's blocking mode never re-arms the worker after its epoll fd fires, so the fd
        # stays readable and the loop spins at 100% CPU for the life of the process (both
        # kvds, idle too): replace its reader with one that progresses and re-arms.
        fd = self._worker.epoll_file_descriptor
        loop.remove_reader(fd)
        loop.add_reader(fd, self._on_ucx_event)
        self._poller = loop.create_task(self._poll())

    def _on_ucx_event(self) -> None:
        self._worker.progress()
        self._reap()
        if self._num_active == 0:
            self._arm()
        # else the poller spins the worker, and re-arms when the last transfer ends

    def _arm(self) -> None:
        """Arm the worker so its fd wakes the loop on the next event (ucp_worker_arm: only
        once nothing is left to progress)."""
        while not self._worker.arm():
            self._worker.progress()

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for node_id in list(self._eps):
            self.drop(node_id)

    async def _poll(self) -> None:
        """Spin the worker while transfers are active (blocking mode alone adds wake-up
        latency of milliseconds); back off to 1 ms sleeps while a peer is silent."""
        worker = self._worker
        idle = 0
        while True:
            if self._num_active == 0:
                self._arm()
                self._wake.clear()
                await self._wake.wait()
                idle = 0  # a new transfer: spin at once (not at the silent peer's 1 ms pace)
            progressed = worker.progress_once()
            self._reap()  # also requests that completed inline when posted
            if progressed:
                idle = 0
                await asyncio.sleep(0)
            else:
                idle += 1
                await asyncio.sleep(0 if idle < 2000 else 0.001)

    def _reap(self) -> None:
        """Resolve the futures of finished UCX requests. ucxx's own ``await ep.send()`` makes
        each request a task spinning on ``asyncio.sleep(0)``: with 64 messages in flight that
        is 64 task steps per worker progress; one scan here is far cheaper."""
        if not self._requests:
            return
        left = []
        for entry in self._requests:
            req, fut, _ = entry
            if not req.completed:
                left.append(entry)  # even if cancelled: UCX still owns the buffer
                continue
            if fut.done():  # cancelled by the caller
                continue
            try:
                req.check_error()
                fut.set_result(None)
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
                fut.set_exception(exc)
        self._requests = left

    def _post(self, ep: Any, buf: np.ndarray, tag: int, send: bool) -> asyncio.Future[None]:
        arr, t = self._array(buf), self._tag(tag)
        raw = ep._ep  # ucxx's core endpoint: requests without a spinning task each
        req = raw.tag_send(arr, t) if send else raw.tag_recv(arr, t, self._tag_mask)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._requests.append((req, fut, arr))
        return fut

    def _begin(self) -> None:
        self._num_active += 1
        self._wake.set()

    def _end(self) -> None:
        self._num_active -= 1

    def plan(self, src_slots: Sequence[int], dst_slots: Sequence[int]) -> list[Message]:
        return plan_messages(src_slots, dst_slots, self._slot_bytes, self._max_message_bytes)

    async def endpoint(self, node_id: str, address: bytes) -> Any:
        """The cached endpoint to ``node_id`` (re-made when its worker address changed)."""
        lock = self._ep_locks.setdefault(node_id, asyncio.Lock())
        async with lock:
            cached = self._eps.get(node_id)
            if cached is not None and cached[0] == address:
                return cached[1]
            if cached is not None:
                self.drop(node_id)
            try:
                addr = self._ucxx.get_ucx_address_from_buffer(address)
                ep = await self._ucxx.create_endpoint_from_worker_address(
                    addr, endpoint_error_handling=self._error_handling)
            except self._errors as exc:
                raise TransportError(f"cannot reach {node_id}: {exc}") from exc
            self._eps[node_id] = (address, ep)
            self.lanes[node_id] = endpoint_lanes(ep)
            log.info("ucx endpoint", extra={"fields": {
                "peer": node_id, "transports": ",".join(self.lanes[node_id]) or "unknown"}})
            return ep

    def drop(self, node_id: str) -> None:
        """Abort the endpoint to ``node_id``: every send/receive posted on it is cancelled."""
        cached = self._eps.pop(node_id, None)
        if cached is not None:
            cached[1].abort()

    def _view(self, slot: int, num_blocks: int) -> np.ndarray:
        start = self._data_offset + slot * self._slot_bytes
        return self._pool[start:start + num_blocks * self._slot_bytes]

    def _outgoing(self, m: Message) -> np.ndarray:
        view = self._view(m.src_slot, m.num_blocks)
        n = self._faults.corrupt_every
        first = self._num_sent_blocks
        self._num_sent_blocks += m.num_blocks
        if n <= 0:
            return view
        bad = [i for i in range(m.num_blocks) if (first + i + 1) % n == 0]
        if not bad:
            return view
        copy = view.copy()  # test hook: corrupt in transit, never in the pool
        for i in bad:
            copy[i * self._slot_bytes] ^= 0xFF
        return copy

    async def send(self, ep: Any, transfer_id: int, messages: Sequence[Message],
                   codec: WireCodec | None = None) -> None:
        """Send every message (all posted at once, so UCX pipelines them); through ``codec``
        when the transfer negotiated one (wirecodec.py)."""
        self._begin()
        try:
            if self._faults.send_delay_ms:
                await asyncio.sleep(self._faults.send_delay_ms / 1000)
            bufs = [self._outgoing(m) for m in messages]
            if codec is not None:
                bufs = [codec.encode(b) for b in bufs]
            await asyncio.gather(*[
                self._post(ep, buf, message_tag(transfer_id, i), send=True)
                for i, buf in enumerate(bufs)])
        except self._errors as exc:
            raise TransportError(f"send failed: {exc}") from exc
        finally:
            self._end()

    def post_receives(self, ep: Any, transfer_id: int, messages: Sequence[Message],
                      codec: WireCodec | None = None) -> list[asyncio.Task[int]]:
        """One task per message, each returning its index once the bytes are in the pool
        (received into a buffer and decoded there, with a ``codec``)."""

        async def one(i: int, m: Message) -> int:
            view = self._view(m.dst_slot, m.num_blocks)
            buf = view if codec is None else codec.receive_buffer(view.nbytes)
            caught: tuple[type[BaseException], ...] = (*self._errors, ValueError)
            self._begin()
            try:
                await self._post(ep, buf, message_tag(transfer_id, i), send=False)
                if codec is not None:
                    codec.decode(buf, view)
            except caught as exc:
                raise TransportError(f"receive failed: {exc}") from exc
            finally:
                self._end()
            return i

        return [asyncio.create_task(one(i, m)) for i, m in enumerate(messages)]
