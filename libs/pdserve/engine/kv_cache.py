"""Paged KV storage and the per-request block manager.

Storage: one tensor for all layers, so one page of every layer is one wire block:

    data : [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]
    data[l]    -> FlashInfer NHD paged cache of layer l (contiguous)
    data[:, p] -> the wire block of page p: [layers][2][block_size][kv_heads][head_dim]

Manager: a request owns the pages covering its computed tokens plus those scheduled this step.

    token_ids  |b0 full|b1 full|b2 full|b3 part.|
    blocks     [  p7   ,  p2   ,  p9   ,  p4    ]
               |-- cached (hash registered) --|  ^ only full, computed blocks get a hash

A prefix hit takes back cached pages by hash; it never covers the last prompt token, whose
logits must be computed.
"""

from __future__ import annotations

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request
from pdserve.hashing import hash_blocks


class PagedKVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.page_size = page_size
        self.data = torch.zeros(num_layers, num_pages, 2, page_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)

    @property
    def layers(self) -> list[torch.Tensor]:
        return list(self.data.unbind(0))

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one wire block: [layers, 2, block_size, kv_heads, head_dim]."""
        s = self.data.shape
        return (s[0], *s[2:])

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * elem

    def export_pages(self, page_ids: list[int], out: torch.Tensor) -> None:
        """Gather pages into ``out`` [n, layers, 2, block_size, kv_heads, head_dim]."""
        expected = (len(page_ids), *self.block_shape)
        if tuple(out.shape) != expected:
            raise ValueError(f"out must have shape {expected}, got {tuple(out.shape)}")
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.data.device)
        out.copy_(self.data.index_select(1, idx).transpose(0, 1))

    def import_pages(self, page_ids: list[int], data: torch.Tensor) -> None:
        """Scatter wire-layout blocks ``data`` [n, layers, ...] into pages ``page_ids``."""
        expected = (len(page_ids), *self.block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"data must have shape {expected}, got {tuple(data.shape)}")
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.data.device)
        src = data.to(device=self.data.device, dtype=self.data.dtype).transpose(0, 1)
        self.data.index_copy_(1, idx, src)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: str,
                 enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}  # leading blocks already hashed into the pool

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_hashes(self, req: Request) -> None:
        """Extend ``req.block_hashes`` to every full block of its current tokens."""
        start = len(req.block_hashes) * self.block_size
        if req.num_tokens - start >= self.block_size:
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.extend(hash_blocks(req.token_ids[start:], self.block_size,
                                                self.fingerprint, req.cache_salt, parent))

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Pages of the longest cached prefix of a request that holds no blocks yet."""
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(req)
        max_hit = (req.num_tokens - 1) // self.block_size  # keep the last token to compute
        hits: list[int] = []
        for h in req.block_hashes[:max_hit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       hit_blocks: list[int] | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed (and hit) ones.
        Takes the hit pages; returns the fresh page ids, or None (nothing changed) if the pool
        is short."""
        hit_blocks = hit_blocks or []
        held = self.req_blocks.setdefault(req.request_id, [])
        num_total = req.num_computed_tokens + len(hit_blocks) * self.block_size + num_new_tokens
        num_needed = self.num_blocks_for(num_total) - len(held) - len(hit_blocks)
        if num_needed > self.pool.num_free_after_touch(hit_blocks):
            if not held:
                del self.req_blocks[req.request_id]
            return None
        self.pool.touch(hit_blocks)
        held.extend(hit_blocks)
        if hit_blocks:
            self._num_committed[req.request_id] = len(held)
        new = self.pool.allocate(max(num_needed, 0))
        assert new is not None
        held.extend(new)
        return new

    def commit(self, req: Request) -> list[tuple[bytes, int]]:
        """Register the request's newly completed full blocks (tokens all computed) in the
        prefix cache; returns their (hash, page id) in order."""
        num_full = req.num_computed_tokens // self.block_size
        start = self._num_committed.get(req.request_id, 0)
        if num_full <= start:
            return []
        self.update_hashes(req)
        held = self.req_blocks[req.request_id]
        out = []
        for i in range(start, num_full):
            if self.enable_prefix_caching:
                self.pool.cache(held[i], req.block_hashes[i])
            out.append((req.block_hashes[i], held[i]))
        self._num_committed[req.request_id] = num_full
        return out

    def free(self, req: Request) -> None:
        """Return all of a request's pages; the tail goes first so it is evicted first."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self._num_committed.pop(req.request_id, None)
        self.pool.free(reversed(blocks))

    def import_begin(self, hashes: list[bytes]) -> tuple[list[int], list[int], list[int]]:
        """Take free pages for the hashes not cached yet (as many as fit, in chain order).
        Returns (indices into ``hashes``, their new page ids, pinned pages); the new pages are
        held until ``import_end`` so the caller can fill them, and the chain's already cached
        pages are pinned meanwhile so taking pages cannot evict them."""
        present = [b for h in hashes if (b := self.pool.lookup(h)) is not None]
        self.pool.touch(present)
        todo = [i for i, h in enumerate(hashes) if self.pool.lookup(h) is None]
        todo = todo[: self.pool.num_free]
        pages = self.pool.allocate(len(todo))
        assert pages is not None
        return todo, pages, present

    def import_end(self, hashes: list[bytes], pages: list[int], pinned: list[int]) -> None:
        for h, p in zip(hashes, pages, strict=True):
            self.pool.cache(p, h)
        # Free tail-first so the chain's head, the most shareable part, is evicted last.
        self.pool.free(reversed(pages))
        self.pool.free(pinned)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        counts: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                counts[b] = counts.get(b, 0) + 1
        for b, n in counts.items():
            if self.pool.blocks[b].ref_cnt != n:
                raise RuntimeError(f"kv cache: block {b} has ref_cnt "
                                   f"{self.pool.blocks[b].ref_cnt} but {n} holders")
        if sum(counts.values()) != sum(blk.ref_cnt for blk in self.pool.blocks):
            raise RuntimeError("kv cache: pool holds references no request owns")
