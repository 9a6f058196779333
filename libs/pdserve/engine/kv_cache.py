"""Paged KV storage and the per-request block manager.

Storage: one tensor for all layers, so one page of every layer is one wire block:

    data : [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]
    data[l]    -> FlashInfer NHD paged cache of layer l (contiguous)
    data[:, p] -> the wire block of page p: [layers][2][block_size][kv_heads][head_dim]
    scales     -> quantized caches only (fp8/int8): [num_layers, num_pages, 2, page_size,
                  num_kv_heads] float32, appended to the wire block (attention/kv_quant.py)

Manager: a request owns the pages covering its computed tokens plus those scheduled this step.

    token_ids  |b0 full|b1 full|b2 full|b3 part.|
    blocks     [  p7   ,  p2   ,  p9   ,  p4    ]
               |-- cached (hash registered) --|  ^ only full, computed blocks get a hash

A prefix hit takes back cached pages by hash; it never covers the last prompt token, whose
logits must be computed.
"""

from __future__ import annotations

import torch

from pdserve.attention.kv_quant import SCALE_DTYPE, KVQuant, bytes_per_token
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request
from pdserve.hashing import hash_blocks


class PagedKVCache:
    """Values ``data`` (the model's dtype, or a quantized one) and, when quantized, one float32
    scale per token and head in ``scales`` [layers, pages, 2, page_size, kv_heads]. A wire
    block is the page's values, then (quantized) its scales, as raw bytes::

        unquantized  [layers, 2, block_size, kv_heads, head_dim] of the model's dtype
        quantized    uint8 [values: layers*2*bs*kvh*hd bytes | scales: layers*2*bs*kvh*4]

    ``unit_scales``: every scale stays 1.0 (a cache FlashInfer reads, kv_quant.py); imported
    blocks are re-quantized to it."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 quant: KVQuant | None = None, unit_scales: bool = False) -> None:
        self.page_size = page_size
        self.quant = quant
        self.unit_scales = unit_scales and quant is not None
        shape = (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype if quant is None else quant.storage,
                                device=device)
        self.scales: torch.Tensor | None = None
        if quant is not None:
            self.scales = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device)

    @property
    def layers(self) -> list[torch.Tensor]:
        return list(self.data.unbind(0))

    @property
    def layer_scales(self) -> list[torch.Tensor] | None:
        return None if self.scales is None else list(self.scales.unbind(0))

    @property
    def values_shape(self) -> tuple[int, ...]:
        """Shape of one page's values: [layers, 2, block_size, kv_heads, head_dim]."""
        s = self.data.shape
        return (s[0], *s[2:])

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one wire block (see the class docstring)."""
        if self.scales is None:
            return self.values_shape
        return (self._values_bytes + self.scales[:, 0].numel() * self.scales.element_size(),)

    @property
    def block_dtype(self) -> torch.dtype:
        return self.data.dtype if self.scales is None else torch.uint8

    @property
    def _values_bytes(self) -> int:
        return self.data[:, 0].numel() * self.data.element_size()

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, quant: KVQuant | None = None) -> int:
        return page_size * bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, quant)

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """Pages ``idx`` as contiguous wire blocks [n, *block_shape] (on the cache's device)."""
        vals = self.data.index_select(1, idx).transpose(0, 1).contiguous()
        if self.scales is None:
            return vals
        n = len(idx)
        scales = self.scales.index_select(1, idx).transpose(0, 1).contiguous()
        return torch.cat([vals.view(torch.uint8).reshape(n, -1),
                          scales.view(torch.uint8).reshape(n, -1)], dim=1)

    def scatter(self, idx: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write wire blocks [n, *block_shape] (on the cache's device) into pages ``idx``."""
        if self.scales is None or self.quant is None:
            self.data.index_copy_(1, idx, blocks.to(self.data.dtype).transpose(0, 1))
            return
        n, vb = len(idx), self._values_bytes
        raw = blocks.view(torch.uint8)
        vals = raw[:, :vb].contiguous().view(self.data.dtype).view(n, *self.values_shape)
        scales = raw[:, vb:].contiguous().view(SCALE_DTYPE).view(n, *self.values_shape[:-1])
        if self.unit_scales:
            vals, scales = self.quant.quantize(
                self.quant.dequantize(vals, scales, torch.float32), unit=True)
        # index_copy_ has no float8 kernel on CPU: copy the values as bytes.
        self.data.view(torch.uint8).index_copy_(1, idx, vals.view(torch.uint8).transpose(0, 1))
        self.scales.index_copy_(1, idx, scales.transpose(0, 1))

    def export_pages(self, page_ids: list[int], out: torch.Tensor) -> None:
        """Gather pages into ``out`` [n, *block_shape] (wire blocks)."""
        expected = (len(page_ids), *self.block_shape)
        if tuple(out.shape) != expected:
            raise ValueError(f"out must have shape {expected}, got {tuple(out.shape)}")
        if self.scales is None:  # page by page straight into ``out``: no gathered copy between
            for i, page in enumerate(page_ids):
                out[i].copy_(self.data[:, page])
            return
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.data.device)
        out.copy_(self.gather(idx))

    def import_pages(self, page_ids: list[int], data: torch.Tensor) -> None:
        """Scatter wire blocks ``data`` [n, *block_shape] into pages ``page_ids``."""
        expected = (len(page_ids), *self.block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"data must have shape {expected}, got {tuple(data.shape)}")
        idx = torch.tensor(page_ids, dtype=torch.long, device=self.data.device)
        self.scatter(idx, data.to(device=self.data.device))


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
