"""FlashInfer paged attention (CUDA only; this module is imported only by ``get_backend``).

Same cache layout as the torch backend: per layer ``[pages, 2, page_size, kv_heads, head_dim]``
(FlashInfer's NHD single-tensor form), so blocks move between instances regardless of backend.
``prepare`` builds FlashInfer's CSR page table once per step, as host int32 tensors (pinned on
CUDA: ``plan()`` copies what it needs itself; the store's indices travel in one packed
non-blocking copy), and plans either the decode wrapper (one new token per sequence) or the
prefill wrapper (causal, which FlashInfer aligns to the end of each sequence's KV, i.e. causal
over cached prefixes)::

    kv_indptr     [B + 1]   pages of seq b are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
    kv_indices    [pages]
    last_page_len [B]       tokens in each sequence's last page (1..page_size)
    batch_indices [T]       the sequence of each new token     } where append_paged_kv_cache
    positions     [T]       its position in that sequence      } writes its K and V

Decode uses FlashInfer's tensor-core kernel when a KV head serves more than 4 query heads: the
CUDA-core kernel only instantiates groups {1, 2, 3, 4, 6, 8} and is the slower one there.
``graph_bucket(batch_size, max_pages)`` gives a decode wrapper and store inputs with fixed
buffers, for CUDA graph capture. FlashInfer itself is imported only when a backend is built.

An fp8 cache (``--kv-cache-dtype fp8``) is passed natively: ``kv_data_type`` float8_e4m3fn,
q in the model's dtype, new K/V cast to e4m3 (clamped to ±448) before the append. FlashInfer's
fp8 kernels take one scalar ``k_scale``/``v_scale`` per call, not per-token scales, so this
cache keeps unit scales (``PagedKVCache.unit_scales``; kv_quant.py) and runs with scale 1.0.
int8 has no FlashInfer kernel. (Planned and checked on CPU with the stand-in; not yet run on
a GPU.)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024
HEAD_DIMS = (64, 128, 256, 512)  # what FlashInfer's kernels dispatch
MAX_CUDA_CORE_GROUP = 4  # larger query-head groups use the tensor-core decode kernel
DTYPES = (torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def unsupported_reason(head_dim: int, num_qo_heads: int, num_kv_heads: int,
                       dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str | None:
    """Why FlashInfer cannot serve this attention shape (``dtype``: q's, ``kv_dtype``: the
    cache's, default the same), or None when it can."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one FlashInfer dispatches {HEAD_DIMS}"
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        return (f"{num_qo_heads} query heads are not a whole multiple of {num_kv_heads} "
                "KV heads")
    if dtype not in DTYPES:
        return f"dtype {dtype} is not float16 or bfloat16"
    if kv_dtype is not None and kv_dtype not in (dtype, FP8):
        return (f"KV cache dtype {kv_dtype} has no FlashInfer kernel (fp8 e4m3 or the "
                "model's dtype)")
    return None


def load_flashinfer() -> ModuleType:
    """The flashinfer package with the submodules this backend uses imported."""
    fi = importlib.import_module("flashinfer")
    importlib.import_module("flashinfer.page")
    return fi


@dataclass
class StepPlan:
    """One step's FlashInfer inputs, built on the host (see the module docstring)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    batch_indices: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def build(cls, metadata: AttentionMetadata, page_size: int) -> StepPlan:
        qo = metadata.qo_indptr.to("cpu", torch.int32)
        kv_lens = metadata.kv_lens.to("cpu", torch.int32)
        q_lens = qo[1:] - qo[:-1]
        num_pages = (kv_lens + page_size - 1) // page_size
        counts = num_pages.tolist()
        indices = [p for pages, n in zip(metadata.page_table, counts, strict=True)
                   for p in pages[:n]]
        kv_indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
        kv_indptr[1:] = num_pages.cumsum(0)
        seq = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), q_lens)
        first_new = (kv_lens - q_lens)[seq.long()]
        positions = first_new + torch.arange(len(seq), dtype=torch.int32) - qo[:-1][seq.long()]
        return cls(qo, kv_indptr, torch.tensor(indices, dtype=torch.int32),
                   (kv_lens - 1) % page_size + 1, seq, positions.to(torch.int32))

    def pinned(self) -> StepPlan:
        return StepPlan(self.qo_indptr.pin_memory(), self.kv_indptr.pin_memory(),
                        self.kv_indices.pin_memory(), self.last_page_len.pin_memory(),
                        self.batch_indices, self.positions)


@dataclass
class GraphBucket:
    """A decode wrapper in CUDA graph mode and the store's fixed inputs, for one batch size."""

    decoder: Any
    store: tuple[torch.Tensor, ...]


class FlashInferBackend(AttentionBackend):
    def __init__(self, kv_caches: list[torch.Tensor], num_qo_heads: int,
                 scale: float | None = None, fi: ModuleType | None = None,
                 q_dtype: torch.dtype | None = None) -> None:
        self.kv_caches = kv_caches
        _, _, self.page_size, self.num_kv_heads, self.head_dim = kv_caches[0].shape
        self.num_qo_heads = num_qo_heads
        self.scale = scale
        self.device = kv_caches[0].device
        self.kv_dtype = kv_caches[0].dtype
        self.dtype = q_dtype or self.kv_dtype
        self.is_fp8 = self.kv_dtype == FP8
        reason = unsupported_reason(self.head_dim, num_qo_heads, self.num_kv_heads, self.dtype,
                                    self.kv_dtype)
        if reason is not None:
            raise ValueError(f"attention_backend 'flashinfer': {reason}")
        self.fi = fi if fi is not None else load_flashinfer()
        self.use_tensor_cores = num_qo_heads // self.num_kv_heads > MAX_CUDA_CORE_GROUP
        # FlashInfer's split-k reduction reads this buffer before writing it: zeroed, once.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode = self._decoder()
        self._prefill = self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2")
        self._wrapper: Any = self._decode
        self._buckets: dict[int, GraphBucket] = {}
        self._store: tuple[torch.Tensor, ...] = ()

    def _decoder(self, graph_buffers: tuple[torch.Tensor, ...] | None = None) -> Any:
        kwargs: dict[str, Any] = {"use_tensor_cores": self.use_tensor_cores, "backend": "fa2"}
        if graph_buffers is not None:
            indptr, indices, last = graph_buffers
            kwargs.update(use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
                          paged_kv_indices_buffer=indices,
                          paged_kv_last_page_len_buffer=last)
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", **kwargs)

    def graph_bucket(self, batch_size: int, max_pages: int) -> GraphBucket:
        """The fixed buffers of one CUDA graph bucket: FlashInfer keeps the page table in
        the wrapper's, the store reads its own; every step's plan is copied into them, so a
        captured graph sees it."""
        bucket = self._buckets.get(batch_size)
        if bucket is None:
            dev, i32 = self.device, torch.int32
            indptr = torch.zeros(batch_size + 1, dtype=i32, device=dev)
            indices = torch.zeros(max_pages, dtype=i32, device=dev)
            last = torch.ones(batch_size, dtype=i32, device=dev)
            store = (indices, indptr, last, torch.arange(batch_size, dtype=i32, device=dev),
                     torch.zeros(batch_size, dtype=i32, device=dev))
            bucket = GraphBucket(self._decoder((indptr, indices, last)), store)
            self._buckets[batch_size] = bucket
        return bucket

    def prepare(self, metadata: AttentionMetadata, bucket: GraphBucket | None = None) -> None:
        """Plan the step; with a graph ``bucket`` (a decode-only batch padded to its size)
        its wrapper is planned and the store reads its fixed buffers."""
        plan = StepPlan.build(metadata, self.page_size)
        if self.device.type == "cuda":
            plan = plan.pinned()
        store = self._to_device(plan)
        if bucket is not None:
            for fixed, step in zip(bucket.store, store, strict=True):
                fixed[: len(step)].copy_(step)
            store = bucket.store
        self._store = store
        common: dict[str, Any] = dict(sm_scale=self.scale, q_data_type=self.dtype,
                                      kv_data_type=self.kv_dtype)
        heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)
        if metadata.is_decode_only or bucket is not None:
            self._wrapper = bucket.decoder if bucket is not None else self._decode
            self._wrapper.plan(plan.kv_indptr, plan.kv_indices, plan.last_page_len, *heads,
                               pos_encoding_mode="NONE", **common)
        else:
            self._wrapper = self._prefill
            self._prefill.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                               plan.last_page_len, *heads, causal=True, **common)

    def _to_device(self, plan: StepPlan) -> tuple[torch.Tensor, ...]:
        """kv_indices, kv_indptr, last_page_len, batch_indices, positions on the device, in
        one packed copy (non-blocking from pinned memory on CUDA)."""
        parts = (plan.kv_indices, plan.kv_indptr, plan.last_page_len, plan.batch_indices,
                 plan.positions)
        packed = torch.cat(parts)
        if self.device.type == "cuda":
            packed = packed.pin_memory()
        on_dev = packed.to(self.device, non_blocking=True)
        return tuple(on_dev.split([len(p) for p in parts]))

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        cache = self.kv_caches[layer_id]
        kv_indices, kv_indptr, last_page_len, batch_indices, positions = self._store
        if self.is_fp8:  # unit scales: cast as is (e4m3 saturates at ±448; NaN beyond)
            k = k.clamp(-FP8_MAX, FP8_MAX).to(FP8)
            v = v.clamp(-FP8_MAX, FP8_MAX).to(FP8)
        # Store first (one kernel for K and V): the new tokens attend to themselves.
        self.fi.page.append_paged_kv_cache(
            k, v, batch_indices, positions, cache, kv_indices, kv_indptr, last_page_len,
            kv_layout="NHD")
        if self.is_fp8:
            return self._wrapper.run(q.contiguous(), cache, k_scale=1.0, v_scale=1.0)
        return self._wrapper.run(q.contiguous(), cache)
