"""Moving KV blocks between the engine's pages and the node kvd's shared-memory slots.

    engine pages ──export_blocks──► kvd slots (allocate → write → commit [+ push to dest])
    engine pages ◄─import_blocks─── kvd slots (lookup / await → pins → read → release)

Both copies run between steps (``AsyncEngine.call``: on the engine thread, or on the caller's
while a CPU engine's thread is parked and the copy is small, ``INLINE_COPY_BYTES``), straight into
or out of the zero-copy slot views, so the bytes are copied once per direction; on CUDA they
are pinned, asynchronous copies on a side stream (``kvd/staging.py``). Slots are pinned
only for the copy: a commit releases the writer's pins, an import releases the reader's (its
Release is sent once the copy is done and answered in the background: ``release_later``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import Engine
from pdserve.errors import StatusError
from pdserve.hashing import block_checksum
from pdserve.kvd.client import CommitEntry, KvdClient, Pin
from pdserve.kvd.layout import BlockLayout
from pdserve.kvd.staging import KvStaging, Ticket
from pdserve.proto.v1 import common_pb2

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

# Copies of at most this many bytes may run on the event loop while the engine thread is parked
# (``AsyncEngine.call(inline=True)``): the hand-off to the engine thread and back costs more
# than they take; a larger copy would hold up the loop's other work.
INLINE_COPY_BYTES = 4 << 20


@dataclass(frozen=True)
class Exported:
    """A block held by the kvd: its hash and the xxh3 checksum of its bytes."""

    hash: bytes
    checksum: int


def _kvd_status(fn: F) -> F:
    """The kvd's failures as the engine's callers see them: its status code, marked as the
    kvd's; a wait that ran out as DEADLINE_EXCEEDED. While the kvd is lost (it died: the
    session ended) calls fail at once with UNAVAILABLE, and calls in flight when it is lost
    fail then, not at their deadlines; a kvd that answers "no block layout registered" (it
    restarted) is lost too."""

    @functools.wraps(fn)
    async def wrapper(self: KvBridge, *args: Any, **kwargs: Any) -> Any:
        lost = self.check_connected()
        call = asyncio.ensure_future(fn(self, *args, **kwargs))
        waiter = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait((call, waiter), return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                raise self.unavailable()
            return call.result()
        except grpc.aio.AioRpcError as exc:
            if _is_unregistered(exc):
                self.mark_lost("it restarted (no block layout registered)")
                raise self.unavailable() from exc
            raise StatusError(exc.code(), f"kvd: {exc.details()}") from exc
        except TimeoutError as exc:
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"kvd: {exc or 'timed out'}") from exc
        finally:
            call.cancel()
            waiter.cancel()

    return wrapper  # type: ignore[return-value]


def _is_unregistered(exc: grpc.aio.AioRpcError) -> bool:
    return (exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            and "no block layout registered" in (exc.details() or ""))


class KvBridge:
    def __init__(self, aengine: AsyncEngine, client: KvdClient, address: str) -> None:
        self.aengine = aengine
        self.client = client
        self.address = address
        self.node_id = ""
        self.epoch = 0
        self.staging: KvStaging | None = None
        self._lost = asyncio.Event()
        self._lost.set()  # until registered
        self.lost_reason = "not registered yet"
        self.on_lost: Callable[[], None] = lambda: None  # the link re-registers
        self._releasing: set[asyncio.Task[None]] = set()  # readers' pins on their way back

    # -- connection state -------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        return not self._lost.is_set()

    def check_connected(self) -> asyncio.Event:
        """The event set when the kvd is lost; UNAVAILABLE at once if it already is."""
        if self._lost.is_set():
            raise self.unavailable()
        return self._lost

    def unavailable(self) -> StatusError:
        return StatusError(grpc.StatusCode.UNAVAILABLE,
                           f"kvd {self.address}: {self.lost_reason}; this instance is "
                           "registering with it again: retry (on another instance)")

    def mark_lost(self, reason: str) -> None:
        """The kvd went away (or restarted): fail what waits on it, and re-register."""
        if self._lost.is_set():
            return
        self.lost_reason = reason
        self._lost.set()
        log.warning("kvd lost", extra={"fields": {"kvd": self.address, "reason": reason}})
        self.on_lost()

    async def register(self) -> None:
        """Register the engine's block layout and map the pool (again, after a kvd restart:
        the new pool replaces the old one)."""
        try:
            await self._register()
        except grpc.aio.AioRpcError as exc:
            raise StatusError(exc.code(), f"kvd: {exc.details()}") from exc

    async def _register(self) -> None:
        cfg = self.aengine.engine.config
        layout = BlockLayout(num_layers=cfg.num_layers,
                             block_size=self.aengine.engine.kv.block_size,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                             dtype=self.aengine.engine.kv_dtype,
                             model_fingerprint=self.aengine.engine.fingerprint)
        if self.staging is not None:
            self.staging.close()  # unpinned before the old pool is unmapped
            self.staging = None
        info = await self.client.register(layout)
        self.node_id, self.epoch = info.node_id, info.epoch
        self.staging = KvStaging(self.aengine.engine, self.client)
        self._lost = asyncio.Event()

    @property
    def endpoint(self) -> common_pb2.KvdEndpoint:
        return common_pb2.KvdEndpoint(node_id=self.node_id, address=self.address)

    # -- prefill side ---------------------------------------------------------------------

    @_kvd_status
    async def export(self, blocks: Sequence[tuple[bytes, int]],
                     destination: common_pb2.KvdEndpoint | None) -> list[Exported]:
        """Copy engine pages (hash, page id) into fresh kvd slots and commit them, pushing
        them to ``destination`` at once when given. A block whose page no longer holds it
        when the copy runs (freed and reused since) is left out: the kvd never gets bytes
        that are not the hash's."""
        if not blocks:
            return []
        pins = await self.client.allocate(len(blocks))
        released: set[int] = set()
        try:
            views = [self.client.slot_view(p.slot) for p in pins]
            staging = self._staging()

            def copy_out(engine: Engine) -> tuple[list[int], Ticket]:
                current = [engine.page_of(h, page) for h, page in blocks]
                copied = [i for i, page in enumerate(current) if page is not None]
                pages = [page for page in current if page is not None]
                ticket = staging.export(pages, [views[i] for i in copied],
                                        [self.client.slot_memory(pins[i].slot) for i in copied])
                return copied, ticket

            copied, ticket = await self.aengine.call(copy_out,
                                                     inline=self._small(len(blocks)))
            await ticket.wait_async()  # the slots hold the bytes (pinned, async on CUDA)
            sums = ticket.checksums or [block_checksum(self.client.slot_memory(pins[i].slot))
                                        for i in copied]
            entries = [CommitEntry(pins[i], blocks[i][0], s)
                       for i, s in zip(copied, sums, strict=True)]
            unused = [p.pin_id for i, p in enumerate(pins) if i not in set(copied)]
            if unused:
                released.update(unused)
                self.release_later(unused)
            if entries:
                await self.client.commit(entries, destination, release=True)
        except BaseException:
            await self._release_quietly([p.pin_id for p in pins if p.pin_id not in released])
            raise
        return [Exported(e.hash, e.checksum or 0) for e in entries]

    @_kvd_status
    async def load_prefix(self, hashes: Sequence[bytes], timeout: float) -> list[Exported]:
        """Import the leading run of ``hashes`` the cluster holds: the local kvd's, or a
        longer one another node has (per the index; the local kvd pulls it, e.g. a previous
        turn's answer kept by a decode node). Returns those blocks with the checksums of
        their bytes. A pull that fails costs a cache miss: the local run is loaded instead."""
        if not hashes:
            return []
        here, available = await self.client.lookup_cluster(list(hashes))
        if available > here:
            try:
                return await self._load(hashes[:available], timeout)
            except grpc.aio.AioRpcError as exc:
                log.info("prefix blocks of another node not pulled; using the local ones",
                         extra={"fields": {"error": exc.details(), "num_blocks": available}})
        return await self._load(hashes[:here], timeout) if here else []

    async def _load(self, hashes: Sequence[bytes], timeout: float) -> list[Exported]:
        loaded = list(hashes)
        refs = [common_pb2.BlockRef(hash=h) for h in loaded]
        pins = await self.client.await_blocks(refs, None, timeout)
        sums = await self._import(loaded, pins, with_checksums=True)
        return [Exported(h, c) for h, c in zip(loaded, sums, strict=True)]

    # -- decode side ----------------------------------------------------------------------

    @_kvd_status
    async def receive(self, refs: Sequence[common_pb2.BlockRef],
                      source: common_pb2.KvdEndpoint | None, timeout: float) -> int:
        """Wait for ``refs`` on the local kvd (pulled from ``source`` if not pushed), import
        them into the engine; returns how many pages were newly filled."""
        if not refs:
            return 0
        pins = await self.client.await_blocks(list(refs), source, timeout)
        await self._import([r.hash for r in refs], pins)
        return len(pins)

    async def _import(self, hashes: list[bytes], pins: Sequence[Pin],
                      with_checksums: bool = False) -> list[int]:
        """Copy pinned slots into the engine; returns their checksums when asked."""
        try:
            views = [self.client.slot_view(p.slot) for p in pins]
            sums = ([block_checksum(self.client.slot_memory(p.slot)) for p in pins]
                    if with_checksums else [])
            staging = self._staging()
            _, ticket = await self.aengine.call(lambda _: staging.import_(hashes, views),
                                                inline=self._small(len(views)))
            await ticket.wait_async()  # the slots are read before their pins go
            return sums
        finally:
            self.release_later([p.pin_id for p in pins])

    def release_later(self, pin_ids: list[int]) -> None:
        """Give pins back without waiting for the kvd's answer: the caller's next step (a
        decode's first token) does not depend on it, and on this repository's 2-vCPU machine a
        round trip to a kvd that has gone idle costs 0.2-0.3 ms. A failure is logged as
        ``_release_quietly`` logs it (the pins' lease frees them); ``drain`` waits for them."""
        task = asyncio.ensure_future(self._release_quietly(pin_ids))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def drain(self) -> None:
        """Wait until every ``release_later`` has been answered (before closing the client)."""
        while self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)

    def _small(self, num_blocks: int) -> bool:
        """Whether copying ``num_blocks`` may run inline (``INLINE_COPY_BYTES``)."""
        info = self.client.info
        return info is not None and num_blocks * info.slot_bytes <= INLINE_COPY_BYTES

    def _staging(self) -> KvStaging:
        if self.staging is None:
            raise RuntimeError("kvd bridge: register() first")
        return self.staging

    async def _release_quietly(self, pin_ids: list[int]) -> None:
        try:
            await self.client.release(pin_ids)
        except Exception as exc:  # noqa: BLE001 - the lease frees them anyway; log and go on
            log.warning("kvd release failed; pins expire with their lease",
                        extra={"fields": {"error": str(exc), "num_pins": len(pin_ids)}})
