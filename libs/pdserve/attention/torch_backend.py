"""Paged attention in plain torch (CPU or any device), same layout as FlashInfer.

Each layer's cache ``[pages, 2, page_size, kv_heads, head_dim]`` is viewed as rows of one token's
heads: ``[pages * 2 * page_size, kv_heads * head_dim]``. The K row of token slot (page p,
offset o) is ``p * 2 * page_size + o``; its V row is ``page_size`` further. ``prepare`` turns the
page tables into row indices once per step, for two groups of sequences: decode (one new token
each) and prefill (chunks), so a long chunk never pads every decode row to its length.

    gather rows [2, B, max_kv]         -> K, V of every sequence, padded to the longest context
    mask        [B, 1, max_q, max_kv]  key j visible to new token t of seq i iff
                                         j < kv_len_i and j <= kv_len_i - q_len_i + t
    q index     [B, max_q]             -> the group's flat tokens, padded per sequence

so every layer is one index_copy per K/V (store), then per group one index_select (gather) and
one SDPA, with no Python loop over sequences or tokens. In the decode group (one new token per
sequence) the query heads sharing a KV head are passed as that head's queries,
``[B, kv_heads, heads / kv_heads, D]``, so SDPA reads the gathered K/V once instead of a copy
per query head (``enable_gqa``); docs/benchmarks.md has the numbers and the gather-free
variants that measured slower. Where the native CPU kernel runs (``cpu_decode.py``), a decode
group goes to it instead of SDPA, with each sequence's own length (no mask). A decode batch
that continues the last step's (the caller
passes request ids) attends over a dense copy of its K/V instead of gathering
(``decode_mirror.py``): one new row per sequence per layer is written to it.

A quantized cache (fp8/int8, ``kv_quant.py``) has a second row array of scales
``[pages * 2 * page_size, kv_heads]``: the store quantizes each new token's heads and writes
values and scales at the same rows; the gather reads both and dequantizes to q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionBackend, AttentionMetadata
from pdserve.attention.cpu_decode import DecodeKernel
from pdserve.attention.decode_mirror import MAX_BYTES, DecodeMirror
from pdserve.attention.kv_quant import BY_STORAGE_NAME, KVQuant


class _GroupPlan:
    """Indices and mask for one group of sequences (all tensors built once per step)."""

    def __init__(self, seqs: torch.Tensor, qo: torch.Tensor, kv_lens: torch.Tensor,
                 page_table: list[list[int]], page_size: int) -> None:
        ps, dev = page_size, qo.device
        starts, q_lens, kv_lens = qo[:-1][seqs], (qo[1:] - qo[:-1])[seqs], kv_lens[seqs]
        self.kv_lens = kv_lens.contiguous()
        num_seqs, max_q, max_kv = len(seqs), int(q_lens.max()), int(kv_lens.max())
        max_pages = -(-max_kv // ps)
        table = torch.zeros(num_seqs, max_pages, dtype=torch.long)
        for row, i in enumerate(seqs.tolist()):
            pages = page_table[i][:max_pages]
            table[row, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        j = torch.arange(max_kv, device=dev)
        k_rows = table.to(dev)[:, j // ps] * (2 * ps) + (j % ps)             # [B, max_kv]
        self.gather_rows = torch.cat([k_rows.flatten(), (k_rows + ps).flatten()])
        self.shape = (num_seqs, max_q, max_kv)
        t = torch.arange(max_q, device=dev)
        valid = t[None, :] < q_lens[:, None]                                    # [B, max_q]
        # Flat token ids of this group, in padded order (padding points at a real token).
        self.q_index = torch.where(valid, starts[:, None] + t[None, :], starts[:, None])
        self.out_rows = valid.flatten().nonzero().squeeze(1)
        self.token_index = self.q_index.flatten()[self.out_rows]
        # The whole step with no padding: q is used as is, output rows need no selection.
        self.is_whole_step = len(self.token_index) == int(qo[-1]) == num_seqs * max_q
        self.is_causal = False
        self.mask: torch.Tensor | None = None
        uniform = bool((kv_lens == max_kv).all()) and bool((q_lens == max_q).all())
        if uniform and (max_q == 1 or max_q == max_kv):
            self.is_causal = max_q > 1  # decode sees every key; a fresh square is causal
        else:
            limit = (kv_lens - q_lens)[:, None] + t[None, :]                    # [B, max_q]
            mask = (j[None, None, :] <= limit[:, :, None]) & (
                j[None, None, :] < kv_lens[:, None, None])
            mask[:, :, 0] = True  # padded query rows must see some key, or SDPA yields NaN
            self.mask = mask[:, None]

    def gather(self, rows: torch.Tensor, num_kv_heads: int, dtype: torch.dtype,
               scale_rows: torch.Tensor | None = None) -> torch.Tensor:
        """K and V of every sequence of the group: [2, B, max_kv, kv_heads * head_dim]."""
        num_seqs, _, max_kv = self.shape
        if scale_rows is None:
            kv = rows.index_select(0, self.gather_rows).to(dtype)
        else:
            vals = rows.view(torch.uint8).index_select(0, self.gather_rows).view(rows.dtype)
            kv = KVQuant.dequantize(vals.view(-1, num_kv_heads, rows.shape[1] // num_kv_heads),
                                    scale_rows.index_select(0, self.gather_rows).view(-1,
                                                                                  num_kv_heads),
                                    dtype)
        return kv.view(2, num_seqs, max_kv, -1)

    def attend(self, q: torch.Tensor, kv: torch.Tensor, num_kv_heads: int,
               scale: float | None, native: DecodeKernel | None = None) -> torch.Tensor:
        """q: the step's [T, H, D]; kv: ``gather``'s layout (or a view of the same shape);
        returns [tokens of this group, H, D] in token order. ``native``: the CPU decode
        kernel (``cpu_decode.py``), used for a decode group."""
        num_seqs, max_q, max_kv = self.shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        qp = q if self.is_whole_step else q.index_select(0, self.q_index.flatten())
        if max_q == 1 and native is not None:
            # Each sequence's own length bounds its keys: no mask, no padded key is read.
            qg = qp.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
            out = native(qg.contiguous(), kv.to(q.dtype), self.kv_lens,
                         head_dim ** -0.5 if scale is None else scale)
            return out.reshape(num_seqs, num_heads, head_dim)
        kv = kv.to(q.dtype).view(2, num_seqs, max_kv, num_kv_heads, head_dim).transpose(2, 3)
        if max_q == 1:
            # Decode: the query heads sharing a KV head are that head's queries, so SDPA
            # reads K and V as stored, with no per-head copy (enable_gqa expands them).
            qp = qp.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
            out = F.scaled_dot_product_attention(qp, kv[0], kv[1], attn_mask=self.mask,
                                                 scale=scale)
            return out.reshape(num_seqs, num_heads, head_dim)
        qp = qp.view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qp, kv[0], kv[1], attn_mask=self.mask, is_causal=self.is_causal, scale=scale,
            enable_gqa=num_heads != num_kv_heads)
        out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
        return out if self.is_whole_step else out[self.out_rows]


class TorchBackend(AttentionBackend):
    def __init__(self, kv_caches: list[torch.Tensor], scale: float | None = None,
                 kv_scales: list[torch.Tensor] | None = None, unit_scales: bool = False,
                 mirror_bytes: int | None = None, native: DecodeKernel | None = None) -> None:
        if not kv_caches:
            raise ValueError("kv_caches must hold one tensor per layer")
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self.unit_scales = unit_scales  # write as FlashInfer does (fp8, scale 1): kv_quant.py
        self.quant = BY_STORAGE_NAME.get(str(kv_caches[0].dtype).removeprefix("torch."))
        if (self.quant is None) != (kv_scales is None):
            raise ValueError("kv_scales must be given exactly when the cache is quantized "
                             f"(cache dtype {kv_caches[0].dtype})")
        _, _, self.page_size, self.num_kv_heads, self.head_dim = kv_caches[0].shape
        self.scale = scale
        self.device = kv_caches[0].device
        # The CPU decode kernel (cpu_decode.py): decode groups only, any cache it can read.
        self.native = native if self.device.type == "cpu" else None
        self.groups: list[_GroupPlan] = []
        row_bytes = self.num_kv_heads * self.head_dim * kv_caches[0].element_size()
        # CPU only, unquantized: decode_mirror.py says why.
        if self.device.type != "cpu" or self.quant:
            mirror_bytes = 0
        self.mirror = DecodeMirror(len(kv_caches), row_bytes,
                                   MAX_BYTES if mirror_bytes is None else mirror_bytes)

    def prepare(self, metadata: AttentionMetadata) -> None:
        ps, dev = self.page_size, self.device
        qo = metadata.qo_indptr.to(dev, torch.long)
        kv_lens = metadata.kv_lens.to(dev, torch.long)
        slots = metadata.slot_mapping.to(dev, torch.long)
        self.store_k = (slots // ps) * (2 * ps) + slots % ps
        self.store_v = self.store_k + ps
        is_decode = (qo[1:] - qo[:-1]) == 1
        self.groups = [
            _GroupPlan(seqs, qo, kv_lens, metadata.page_table, ps)
            for seqs in (is_decode.nonzero().squeeze(1), (~is_decode).nonzero().squeeze(1))
            if len(seqs)
        ]
        if (metadata.seq_ids is not None and len(self.groups) == 1
                and self.groups[0].shape[1] == 1):
            self.mirror.plan(metadata.seq_ids, metadata.page_table, metadata.kv_lens.tolist(),
                             dev)
        else:
            self.mirror.clear()

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        rows = self.kv_caches[layer_id].view(-1, self.num_kv_heads * self.head_dim)
        scale_rows = None
        if self.kv_scales is None:
            num_tokens = q.shape[0]
            k_rows = k.reshape(num_tokens, -1).to(rows.dtype)
            v_rows = v.reshape(num_tokens, -1).to(rows.dtype)
            rows.index_copy_(0, self.store_k, k_rows)
            rows.index_copy_(0, self.store_v, v_rows)
            if self.mirror.mode is not None:  # a decode batch: attend over its dense copy
                plan = self.groups[0]
                gather = None if self.mirror.mode == "append" else plan.gather(
                    rows, self.num_kv_heads, rows.dtype)
                kv = self.mirror.update(layer_id, k_rows, v_rows, gather)
                return plan.attend(q, kv, self.num_kv_heads, self.scale, self.native)
        else:
            scale_rows = self.kv_scales[layer_id].view(-1, self.num_kv_heads)
            self._store_quantized(rows, scale_rows, k, v)
        if len(self.groups) == 1:  # one group holds every token, in order
            plan = self.groups[0]
            kv = plan.gather(rows, self.num_kv_heads, q.dtype, scale_rows)
            return plan.attend(q, kv, self.num_kv_heads, self.scale, self.native)
        out = torch.empty_like(q)
        for plan in self.groups:
            kv = plan.gather(rows, self.num_kv_heads, q.dtype, scale_rows)
            out[plan.token_index] = plan.attend(q, kv, self.num_kv_heads, self.scale,
                                                self.native)
        return out

    def _store_quantized(self, rows: torch.Tensor, scale_rows: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> None:
        assert self.quant is not None
        byte_rows = rows.view(torch.uint8)  # index_copy_ has no float8 kernel on CPU
        for store, x in ((self.store_k, k), (self.store_v, v)):
            vals, scales = self.quant.quantize(x, unit=self.unit_scales)
            byte_rows.index_copy_(0, store, vals.reshape(len(x), -1).view(torch.uint8))
            scale_rows.index_copy_(0, store, scales)
