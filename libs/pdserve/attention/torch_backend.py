"""Paged attention in plain torch (CPU or any device), same layout as FlashInfer.

Each layer's cache ``[pages, 2, page_size, kv_heads, head_dim]`` is viewed as rows of one token's
heads: ``[pages * 2 * page_size, kv_heads * head_dim]``. The K row of token slot (page p,
offset o) is ``p * 2 * page_size + o``; its V row is ``page_size`` further. ``prepare`` turns the
page tables into row indices once per step:

    gather rows [2, B, max_kv]      -> K, V of every sequence, padded to the longest context
    mask        [B, 1, max_q, max_kv] key j visible to new token t of seq i iff
                                      j < kv_len_i and j <= kv_len_i - q_len_i + t
    q index     [B, max_q]          -> the step's flat tokens padded per sequence

so every layer is one index_copy (store), one index_select (gather) and one SDPA, with no
Python loop over sequences or tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionBackend, AttentionMetadata


class TorchBackend(AttentionBackend):
    def __init__(self, kv_caches: list[torch.Tensor], scale: float | None = None) -> None:
        if not kv_caches:
            raise ValueError("kv_caches must hold one tensor per layer")
        self.kv_caches = kv_caches
        _, _, self.page_size, self.num_kv_heads, self.head_dim = kv_caches[0].shape
        self.scale = scale
        self.device = kv_caches[0].device

    def prepare(self, metadata: AttentionMetadata) -> None:
        ps, dev = self.page_size, self.device
        qo = metadata.qo_indptr.to(dev, torch.long)
        kv_lens = metadata.kv_lens.to(dev, torch.long)
        q_lens = qo[1:] - qo[:-1]
        num_seqs = metadata.num_seqs
        self.num_tokens = int(qo[-1])
        max_kv = int(kv_lens.max())
        max_q = int(q_lens.max())
        max_pages = -(-max_kv // ps)
        table = torch.zeros(num_seqs, max_pages, dtype=torch.long)
        for i, pages in enumerate(metadata.page_table):
            n = min(len(pages), max_pages)
            table[i, :n] = torch.tensor(pages[:n], dtype=torch.long)
        table = table.to(dev)
        j = torch.arange(max_kv, device=dev)
        k_rows = table[:, j // ps] * (2 * ps) + (j % ps)                     # [B, max_kv]
        self.gather_rows = torch.cat([k_rows.flatten(), (k_rows + ps).flatten()])
        self.shape = (num_seqs, max_q, max_kv)
        slots = metadata.slot_mapping.to(dev, torch.long)
        self.store_k = (slots // ps) * (2 * ps) + slots % ps
        self.store_v = self.store_k + ps
        self.is_causal = False
        self.mask: torch.Tensor | None = None
        self.q_index: torch.Tensor | None = None
        self.out_index: torch.Tensor | None = None
        uniform = bool((kv_lens == max_kv).all()) and bool((q_lens == max_q).all())
        if uniform and (max_q == 1 or max_q == max_kv):
            # Every row sees every key (decode) or a plain causal square: no mask needed.
            self.is_causal = max_q > 1
        else:
            t = torch.arange(max_q, device=dev)
            limit = (kv_lens - q_lens)[:, None] + t[None, :]                   # [B, max_q]
            self.mask = (j[None, None, :] <= limit[:, :, None]) & (
                j[None, None, :] < kv_lens[:, None, None])
            # Padded query rows would see no key at all; let them see key 0 to avoid NaNs.
            self.mask[:, :, 0] = True
            self.mask = self.mask[:, None]
        if max_q > 1 and not uniform:
            valid = t[None, :] < q_lens[:, None]                               # [B, max_q]
            self.q_index = torch.where(valid, qo[:-1, None] + t[None, :], 0)
            self.out_index = valid.flatten().nonzero().squeeze(1)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        cache = self.kv_caches[layer_id]
        rows = cache.view(-1, self.num_kv_heads * self.head_dim)
        num_tokens = q.shape[0]
        rows.index_copy_(0, self.store_k, k.reshape(num_tokens, -1).to(rows.dtype))
        rows.index_copy_(0, self.store_v, v.reshape(num_tokens, -1).to(rows.dtype))
        num_seqs, max_q, max_kv = self.shape
        kv = rows.index_select(0, self.gather_rows).view(
            2, num_seqs, max_kv, self.num_kv_heads, self.head_dim).transpose(2, 3)
        num_heads = q.shape[1]
        qp = q if self.q_index is None else q[self.q_index.flatten()]
        qp = qp.view(num_seqs, max_q, num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qp, kv[0].to(q.dtype), kv[1].to(q.dtype), attn_mask=self.mask,
            is_causal=self.is_causal, scale=self.scale, enable_gqa=num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, self.head_dim)
        return out if self.out_index is None else out[self.out_index]
