"""FlashInfer paged attention (CUDA only; this module is imported only by ``get_backend``).

Same cache layout as the torch backend: per layer ``[pages, 2, page_size, kv_heads, head_dim]``
(FlashInfer's NHD single-tensor form), so blocks move between instances regardless of backend.
``prepare`` converts the page tables to FlashInfer's CSR form once per step and plans either
the decode wrapper (one new token per sequence) or the prefill/append wrapper (causal, which
FlashInfer aligns to the end of each sequence's KV, i.e. causal over cached prefixes).
"""

from __future__ import annotations

import flashinfer
import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    def __init__(self, kv_caches: list[torch.Tensor], num_qo_heads: int,
                 scale: float | None = None) -> None:
        self.kv_caches = kv_caches
        _, _, self.page_size, self.num_kv_heads, self.head_dim = kv_caches[0].shape
        self.num_qo_heads = num_qo_heads
        self.scale = scale
        self.device = kv_caches[0].device
        if self.device.type != "cuda":
            raise ValueError(
                f"attention_backend 'flashinfer' needs CUDA, cache is on {self.device}")
        if kv_caches[0].dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("attention_backend 'flashinfer' needs dtype float16 or bfloat16, "
                             f"got {kv_caches[0].dtype}")
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._wrapper: (flashinfer.BatchDecodeWithPagedKVCacheWrapper
                        | flashinfer.BatchPrefillWithPagedKVCacheWrapper) = self._decode

    def prepare(self, metadata: AttentionMetadata) -> None:
        ps = self.page_size
        kv_lens = metadata.kv_lens.to("cpu", torch.int32)
        num_pages = [-(-int(n) // ps) for n in kv_lens.tolist()]
        tables = zip(metadata.page_table, num_pages, strict=True)
        indices = [p for pages, n in tables for p in pages[:n]]
        indptr = torch.zeros(len(num_pages) + 1, dtype=torch.int32)
        indptr[1:] = torch.tensor(num_pages, dtype=torch.int32).cumsum(0)
        last_page_len = (kv_lens - 1) % ps + 1
        dev = self.device
        paged_indices = torch.tensor(indices, dtype=torch.int32, device=dev)
        slots = metadata.slot_mapping.to(dev, torch.long)
        self._store_pages, self._store_offsets = slots // ps, slots % ps
        dtype = self.kv_caches[0].dtype
        if metadata.is_decode_only:
            self._wrapper = self._decode
            self._decode.plan(
                indptr.to(dev), paged_indices, last_page_len.to(dev), self.num_qo_heads,
                self.num_kv_heads, self.head_dim, ps, pos_encoding_mode="NONE",
                sm_scale=self.scale, q_data_type=dtype, kv_data_type=dtype)
        else:
            self._wrapper = self._prefill
            self._prefill.plan(
                metadata.qo_indptr.to(dev, torch.int32), indptr.to(dev), paged_indices,
                last_page_len.to(dev), self.num_qo_heads, self.num_kv_heads, self.head_dim, ps,
                causal=True, sm_scale=self.scale, q_data_type=dtype, kv_data_type=dtype)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        cache = self.kv_caches[layer_id]
        # Store first: the new tokens attend to themselves through the cache.
        cache[self._store_pages, 0, self._store_offsets] = k.to(cache.dtype)
        cache[self._store_pages, 1, self._store_offsets] = v.to(cache.dtype)
        return self._wrapper.run(q.to(cache.dtype).contiguous(), cache)
