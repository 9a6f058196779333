"""A dense copy of a decode batch's K/V, so consecutive decode steps skip the paged gather.

The torch backend's decode attention gathers every sequence's K and V rows out of the pages
at every layer of every step (``index_select`` of ``2 * B * max_kv`` rows of
``kv_heads * head_dim``), although between two decode steps of the same batch only one token
per sequence is new. The mirror keeps, per layer, ``[2, B, cap, kv_heads * head_dim]``: the
gathered K/V of each sequence, padded to ``cap`` tokens. A step whose batch continues the
last one (same sequences in the same order, each one token longer, each page table extending
the last) only appends the new token's K and V at position ``kv_len - 1`` and attends over
``[:, :, :max_kv]``; any other decode step gathers as before and refills the mirror, with
``cap`` rounded up so that the next ``GROW`` steps fit (fewer, down to ``MIN_HEADROOM``, where
``max_bytes`` allows no more: a cache sized to its batch still gets a mirror).

Why the copy is never stale: a page held by a live sequence changes only by that sequence's
own new tokens (which the store writes to both), prefix-cached pages are full and immutable,
and the check is on request ids as well as page ids, so a request that reuses a finished
one's pages never matches. A step the mirror does not serve (a prefill or mixed batch, a
quantized cache, a batch whose copy exceeds ``max_bytes``) clears it: the next decode
step refills it.

Costs: one more copy of the decode batch's K/V in memory, at most ``max_bytes`` (an engine
sets it from ``EngineArgs.decode_mirror_memory_bytes``: by default the KV cache's own size
up to ``MAX_BYTES``, so an engine's K/V memory is at most twice its cache).
CPU only: CUDA runs FlashInfer's paged kernels, and its memory is planned for the cache
alone. And one full gather per ``GROW`` steps.
"""

from __future__ import annotations

import torch

GROW = 64  # tokens of headroom per sequence after a refill, where the budget allows
MIN_HEADROOM = 16  # fewer would refill (gather) nearly every step: not worth the copy
ALIGN = 16  # cap is a multiple of this where the budget allows
MAX_BYTES = 1 << 30  # all layers together, where no engine setting bounds it


class DecodeMirror:
    def __init__(self, num_layers: int, row_bytes: int, max_bytes: int = MAX_BYTES) -> None:
        self.num_layers, self.row_bytes, self.max_bytes = num_layers, row_bytes, max_bytes
        self.buffers: list[torch.Tensor | None] = [None] * num_layers
        self.cap = 0
        self.mode: str | None = None  # "append", "refill", or None (not serving this step)
        self._last: tuple[list[str], list[list[int]], list[int]] | None = None
        self.append_rows = torch.empty(0, dtype=torch.long)
        self.max_kv = 0

    def clear(self, release: bool = False) -> None:
        """Serve no step until the next refill (``release``: free the buffers too)."""
        self.mode, self._last = None, None
        if release:
            self.buffers = [None] * self.num_layers

    def plan(self, seq_ids: list[str], page_table: list[list[int]], kv_lens: list[int],
             device: torch.device) -> None:
        """Decide how this decode step (one new token per sequence) uses the mirror."""
        self.max_kv = max(kv_lens)
        last = self._last
        if (last is not None and last[0] == seq_ids and self.max_kv <= self.cap
                and all(n == m + 1 for n, m in zip(kv_lens, last[2], strict=True))
                and all(t[:len(p)] == p for t, p in zip(page_table, last[1], strict=True))):
            self.mode = "append"
        else:
            # GROW steps of headroom where the budget allows, at least MIN_HEADROOM.
            fits = self.max_bytes // (2 * len(kv_lens) * self.row_bytes * self.num_layers)
            if fits < self.max_kv + MIN_HEADROOM:
                self.clear(release=True)
                return
            cap = min(-(-(self.max_kv + GROW) // ALIGN) * ALIGN, fits)
            if self.buffers[0] is not None and self.buffers[0].shape[1:3] != (len(kv_lens), cap):
                # New shapes: drop the old buffers before any layer allocates its new one, so
                # the old and new copies are never held together (max_bytes bounds the peak).
                self.buffers = [None] * self.num_layers
            self.mode, self.cap = "refill", cap
        self._last = (list(seq_ids), [list(t) for t in page_table], list(kv_lens))
        rows = torch.arange(len(kv_lens)) * self.cap + torch.tensor(kv_lens) - 1
        self.append_rows = rows.to(device)

    def update(self, layer_id: int, k_rows: torch.Tensor, v_rows: torch.Tensor,
               gather: torch.Tensor | None) -> torch.Tensor:
        """Append the step's ``k_rows``/``v_rows`` [B, row] (mode "append") or store the
        step's full ``gather`` [2, B, max_kv, row] (mode "refill"); returns the mirror's
        ``[2, B, max_kv, row]`` view."""
        buf = self.buffers[layer_id]
        if self.mode == "refill":
            assert gather is not None
            _, num_seqs, max_kv, row = gather.shape
            if buf is None or buf.shape != (2, num_seqs, self.cap, row):
                # Zeros: a shorter sequence's masked tail is read too (weight 0), and
                # 0 * NaN from uninitialized memory would be NaN.
                buf = torch.zeros(2, num_seqs, self.cap, row, dtype=gather.dtype,
                                  device=gather.device)
                self.buffers[layer_id] = buf
            buf[:, :, :max_kv] = gather
        else:
            assert buf is not None
            flat = buf.view(2, -1, buf.shape[-1])
            flat[0].index_copy_(0, self.append_rows, k_rows)
            flat[1].index_copy_(0, self.append_rows, v_rows)
        return buf[:, :, :self.max_kv]
