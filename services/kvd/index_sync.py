"""Keeps the prefix index true for this node, best-effort: Redis being down never blocks kvd.

Block adds/removes are queued by the daemon and flushed in one pipeline per wake-up. A failed
write marks the index unavailable and the node dirty; the queue is dropped (it can no longer be
trusted to be complete). Once a write succeeds again, the node catches up: its entries are
purged and its whole present set re-added. The registry record is refreshed every heartbeat
(TTL 3 heartbeats) and the present set re-added every ttl/3, so live entries never expire.
Every heartbeat also reads the registry back (``on_nodes``): the kvd's view of which peers are
registered stays current while Redis answers and is kept as it was while it does not (Redis
out of this node's reach must not turn known peers into refused ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from pdserve.index import IndexUnavailable, NodeRecord, PrefixIndex

log = logging.getLogger(__name__)


class IndexSync:
    def __init__(self, index: PrefixIndex | None, record: Callable[[], NodeRecord],
                 present: Callable[[], list[bytes]], heartbeat_s: float, ttl_s: float,
                 on_nodes: Callable[[list[NodeRecord]], None] = lambda nodes: None) -> None:
        self._index = index
        self._record = record
        self._present = present
        self._on_nodes = on_nodes
        self._heartbeat_s = heartbeat_s
        self._refresh_s = max(heartbeat_s, ttl_s / 3)
        self._ops: dict[bytes, bool] = {}  # hash -> present (the last queued change wins)
        self._wake = asyncio.Event()
        self._dirty = True  # the first successful round purges the previous epoch's entries
        self._last_refresh = 0.0
        self.available = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._index is not None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._index is not None:
            await self._index.close()

    def added(self, hashes: list[bytes]) -> None:
        if self._index is not None and hashes:
            self._ops.update(dict.fromkeys(hashes, True))
            self._wake.set()

    def removed(self, hashes: list[bytes]) -> None:
        if self._index is not None and hashes:
            self._ops.update(dict.fromkeys(hashes, False))
            self._wake.set()

    async def _run(self) -> None:
        next_beat = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_beat - time.monotonic()))
            self._wake.clear()
            try:
                await self._round(beat=time.monotonic() >= next_beat)
                if not self.available:
                    log.info("prefix index reachable")
                self.available = True
            except IndexUnavailable as exc:
                if self.available or not self._dirty:
                    log.warning("prefix index unreachable; transfers go on",
                                extra={"fields": {"error": str(exc)}})
                self.available, self._dirty = False, True
                self._ops.clear()
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self._heartbeat_s

    async def _round(self, beat: bool) -> None:
        assert self._index is not None
        record = self._record()
        if beat:
            await self._index.register_node(record, ttl=3 * self._heartbeat_s)
            self._on_nodes(await self._index.nodes())
        if self._dirty:
            await self._index.purge_node(record.node_id, record.epoch)
            self._ops.clear()
            self._last_refresh = 0.0
            self._dirty = False
        if time.monotonic() - self._last_refresh >= self._refresh_s:
            self._ops.clear()
            await self._index.add(record.node_id, self._present())
            self._last_refresh = time.monotonic()
        ops, self._ops = self._ops, {}
        await self._index.remove(record.node_id, [h for h, add in ops.items() if not add])
        await self._index.add(record.node_id, [h for h, add in ops.items() if add])
