"""Block pool: ref counts, a free list in LRU order and the hash -> block map (vLLM v1 style).

    free queue (front = evicted first)             used (ref_cnt > 0)
    [ b7 | b3#h | b9#h | b2 | ... ]                 { b0: 2, b1: 1, ... }
      ^ plain or cached-but-unreferenced blocks     ^ held by running requests

A block whose ref count drops to 0 goes to the back of the free queue but keeps its hash, so a
later request with the same prefix can take it back ("touch") instead of recomputing. Taking a
fresh block pops the front: the least recently freed block, whose hash (if any) is evicted.
Invariant (``check_integrity``): every block is either free (ref 0, in the queue) or used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def free_order(self) -> list[int]:
        """Free block ids, next-to-be-taken first (for tests and debugging)."""
        return list(self._free)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def num_free_after_touch(self, block_ids: Sequence[int]) -> int:
        """Free blocks left once ``block_ids`` (cached hits) are taken back from the queue."""
        return self.num_free - sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit)."""
        for b in block_ids:
            blk = self.blocks[b]
            if blk.ref_cnt == 0:
                del self._free[b]
            blk.ref_cnt += 1

    def allocate(self, num: int) -> list[int] | None:
        """``num`` fresh blocks with ref count 1, evicting LRU cached blocks; None if short."""
        if num > self.num_free:
            return None
        out = []
        for _ in range(num):
            b, _ = self._free.popitem(last=False)
            blk = self.blocks[b]
            if blk.block_hash is not None:
                self._evict(blk)
            blk.ref_cnt = 1
            out.append(b)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching 0 join the back of the free queue in the
        order given (callers pass a request's blocks tail-first so its tail is evicted first)."""
        for b in block_ids:
            blk = self.blocks[b]
            if blk.ref_cnt <= 0:
                raise RuntimeError(f"block {b} freed with ref_cnt {blk.ref_cnt}")
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free[b] = None

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full, computed block under its hash. False if the hash is already served
        by another block (the duplicate just stays uncached and is reused as plain memory)."""
        blk = self.blocks[block_id]
        if blk.block_hash is not None:
            return blk.block_hash == block_hash
        if block_hash in self._cached:
            return False
        blk.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def _evict(self, blk: Block) -> None:
        assert blk.block_hash is not None
        del self._cached[blk.block_hash]
        blk.block_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block; returns how many were dropped."""
        dropped = [self.blocks[b] for b in self._free if self.blocks[b].block_hash is not None]
        for blk in dropped:
            self._evict(blk)
        return len(dropped)

    def check_integrity(self) -> None:
        """Raise if free + used != total, a ref count is negative, or the hash map is stale."""
        num_used = sum(1 for blk in self.blocks if blk.ref_cnt > 0)
        if any(blk.ref_cnt < 0 for blk in self.blocks):
            raise RuntimeError("block pool: negative ref count")
        if num_used + self.num_free != self.num_blocks:
            raise RuntimeError(
                f"block pool: free {self.num_free} + used {num_used} != total {self.num_blocks}")
        if any(self.blocks[b].ref_cnt != 0 for b in self._free):
            raise RuntimeError("block pool: a free block has references")
        for h, b in self._cached.items():
            if self.blocks[b].block_hash != h:
                raise RuntimeError(f"block pool: hash map points at block {b} with another hash")
        if sum(1 for blk in self.blocks if blk.block_hash is not None) != len(self._cached):
            raise RuntimeError("block pool: a hashed block is missing from the hash map")
