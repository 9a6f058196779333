"""In-process prefix index for the single-process quick start and unit tests (no Redis)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve.index.base import NodeRecord, PrefixIndex


class LocalPrefixIndex(PrefixIndex):
    """Same contract as ``RedisPrefixIndex``, kept in dicts; expiry by the given clock."""

    def __init__(self, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._blocks: dict[bytes, dict[str, float]] = {}  # hash -> node -> expiry
        self._records: dict[str, tuple[NodeRecord, float]] = {}

    async def add(self, node_id: str, hashes: Sequence[bytes]) -> None:
        expiry = self._clock() + self.ttl_s
        for h in hashes:
            self._blocks.setdefault(h, {})[node_id] = expiry

    async def remove(self, node_id: str, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is not None:
                holders.pop(node_id, None)
                if not holders:
                    del self._blocks[h]

    def _live_nodes(self) -> set[str]:
        now = self._clock()
        return {n for n, (_, exp) in self._records.items() if exp > now}

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        now, live = self._clock(), self._live_nodes()
        counts: dict[str, int] = {}
        running: set[str] | None = None
        for h in hashes:
            here = {n for n, exp in self._blocks.get(h, {}).items() if exp > now and n in live}
            running = here if running is None else running & here
            if not running:
                break
            for n in running:
                counts[n] = counts.get(n, 0) + 1
        return counts

    async def register_node(self, record: NodeRecord, ttl: float) -> None:
        self._records[record.node_id] = (record, self._clock() + ttl)

    async def nodes(self) -> list[NodeRecord]:
        live = self._live_nodes()
        return sorted((r for n, (r, _) in self._records.items() if n in live),
                      key=lambda r: r.node_id)

    async def purge_node(self, node_id: str, epoch: int) -> int:
        current = self._records.get(node_id)
        if current is not None and current[0].epoch > epoch:
            return -1
        mine = [h for h, holders in self._blocks.items() if node_id in holders]
        await self.remove(node_id, mine)
        return len(mine)
