"""KV blocks between an engine's pages and the node kvd's pool, without pageable copies.

The kvd pool is a POSIX shared-memory segment the engine maps (``KvdClient``). On CUDA the
engine registers that mapping with the driver (``cudaHostRegister``), which makes every slot
pinned memory: copies to and from it are DMA, asynchronous, and run on a side stream while the
next chunk computes.

    export (prefill)          compute ──ev──► side: gather pages ──read──► D2H into the slots
                              (on CPU: a plain copy per slot, checksummed right after it)
                              compute waits for "read" only (later steps may then reuse the
                              pages); the bridge waits for "done" off the engine thread, then
                              checksums the slots and commits
    import (decode, prefix)   side: H2D from the pinned slots ─► scatter into fresh pages
                              compute waits for it before the next step; the bridge waits for
                              it before releasing the slots' pins (kvd may then reuse them)

On CPU both are plain synchronous copies (a ``Ticket`` that is already done). Every method
but ``Ticket.wait_async`` runs on the engine thread (``AsyncEngine.call``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.hashing import block_checksum

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine
    from pdserve.kvd.client import KvdClient

log = logging.getLogger(__name__)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class Ticket:
    """One staged copy: done once its event has fired (None: it already is)."""

    def __init__(self, event: torch.cuda.Event | None = None, keep: object = None,
                 checksums: list[int] | None = None) -> None:
        self.event = event
        self._keep = keep  # device buffers the copy still reads
        self.checksums = checksums  # export on CPU: each slot's xxh3, taken right after its copy

    async def wait_async(self) -> None:
        if self.event is not None:
            await asyncio.to_thread(self.event.synchronize)
        self._keep = None


def pin_pool(memory: memoryview) -> int | None:
    """Register the mapped pool with CUDA; its address (for ``unpin_pool``), or None when the
    driver refused (copies then stay correct, only pageable)."""
    base = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(base, len(memory), _HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        log.warning("kvd pool not pinned: cudaHostRegister failed; KV copies are pageable",
                    extra={"fields": {"error": int(err), "bytes": len(memory)}})
        return None
    return base


def unpin_pool(base: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(base)


class KvStaging:
    """Copies between ``engine``'s pages and ``client``'s slots (see the module docstring)."""

    def __init__(self, engine: Engine, client: KvdClient) -> None:
        self.engine = engine
        self.device = engine.device
        self.is_cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._pinned = pin_pool(client.mapped) if self.is_cuda else None

    @property
    def is_pinned(self) -> bool:
        return self._pinned is not None

    def close(self) -> None:
        if self._pinned is not None:
            unpin_pool(self._pinned)
            self._pinned = None

    def export(self, page_ids: Sequence[int], views: Sequence[torch.Tensor],
               memories: Sequence[memoryview] = ()) -> Ticket:
        """Copy pages into slot views (wire blocks: ``PagedKVCache.block_shape``); on CPU the
        ticket has the xxh3 of each of ``memories`` (the slots' bytes), taken while hot."""
        engine = self.engine
        if self.side is None:
            sums = []
            for i, (page, view) in enumerate(zip(page_ids, views, strict=True)):
                engine.export_blocks([page], view.unsqueeze(0))
                if memories:
                    sums.append(block_checksum(memories[i]))
            return Ticket(checksums=sums if memories else None)
        compute = torch.cuda.current_stream(self.device)
        written = torch.cuda.Event()
        written.record(compute)
        with torch.cuda.stream(self.side):
            self.side.wait_event(written)
            idx = torch.tensor(list(page_ids), device=self.device)
            gathered = engine.cache.gather(idx)
            read = torch.cuda.Event()
            read.record(self.side)
            for i, view in enumerate(views):
                view.copy_(gathered[i], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        compute.wait_event(read)
        return Ticket(done, keep=gathered)

    def import_(self, hashes: Sequence[bytes], views: Sequence[torch.Tensor]
                ) -> tuple[int, Ticket]:
        """Fill fresh pages from slot views and cache them under ``hashes``; returns how
        many were new and the ticket to wait on before the slots may be released."""
        tickets: list[Ticket] = []

        def scatter(pages: list[int], blocks: list[torch.Tensor]) -> None:
            tickets.append(self._scatter(pages, blocks))

        num_new = self.engine.import_blocks(list(hashes), list(views), scatter=scatter)
        return num_new, tickets[0] if tickets else Ticket()

    def _scatter(self, pages: list[int], blocks: list[torch.Tensor]) -> Ticket:
        cache = self.engine.cache
        if self.side is None:  # slot by slot into its page: no stacked copy between
            for page, block in zip(pages, blocks, strict=True):
                cache.import_pages([page], block.unsqueeze(0))
            return Ticket()
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.side):
            self.side.wait_stream(compute)  # the pages' last readers are done
            staged = torch.empty((len(blocks), *cache.block_shape), dtype=cache.block_dtype,
                                 device=self.device)
            for i, block in enumerate(blocks):
                staged[i].copy_(block, non_blocking=True)
            cache.scatter(torch.tensor(pages, device=self.device), staged)
            done = torch.cuda.Event()
            done.record(self.side)
        compute.wait_event(done)
        return Ticket(done, keep=staged)
