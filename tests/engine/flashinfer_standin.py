"""A stand-in for the ``flashinfer`` package, in plain torch, for CPU tests of the backend's
planning and index building only (the kernels themselves run in the device check).

It implements FlashInfer's documented semantics for what ``FlashInferBackend`` calls:

- paged KV in the NHD single-tensor layout ``[pages, 2, page_size, kv_heads, head_dim]``;
  sequence b's pages are ``indices[indptr[b]:indptr[b + 1]]``, its last page holds
  ``last_page_len[b]`` tokens, so its KV length is ``(num_pages - 1) * page_size + last``;
- ``page.append_paged_kv_cache``: token i goes to sequence ``batch_indices[i]`` at position
  ``positions[i]``, i.e. page ``indices[indptr[b] + pos // page_size]``, slot ``pos % page_size``;
- the prefill wrapper's ``causal`` mask is aligned to the END of each sequence's KV: query t of a
  sequence with q_len L and kv_len K sees keys ``j <= K - L + t``;
- the decode wrapper's CUDA-core kernel exists only for query-heads-per-KV-head groups
  {1, 2, 3, 4, 6, 8} (otherwise "Unsupported group_size"); the tensor-core one for any group;
- head_dim is dispatched for 64, 128, 256 and 512 only;
- the float workspace "must be initialized to 0 for its first use";
- in CUDA graph mode the page table lives in the buffers given at construction and the batch
  size is fixed by them;
- ``plan``'s ``kv_data_type`` must be the cache's dtype at ``run`` (FlashInfer's
  ``_check_cached_qkv_data_type``), which may be float8_e4m3fn with q in half precision;
  ``run``'s scalar ``k_scale`` multiplies the softmax scale and ``v_scale`` the output
  (flashinfer/decode.py, ``run``).

Every ``plan`` call is recorded in ``PLANS`` (wrapper kind and the arguments) for assertions.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

HEAD_DIMS = (64, 128, 256, 512)
CUDA_CORE_GROUPS = (1, 2, 3, 4, 6, 8)
PLANS: list[dict[str, Any]] = []


def _check_workspace(workspace: torch.Tensor) -> None:
    if workspace.count_nonzero().item():
        raise ValueError("float_workspace_buffer must be initialized to 0 for its first use")


def _check_shape(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> int:
    if head_dim not in HEAD_DIMS:
        raise RuntimeError(f"Unsupported head_dim: {head_dim}")
    if num_qo_heads % num_kv_heads:
        raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
    return num_qo_heads // num_kv_heads


def _check_dtype(planned: Any, cache: torch.Tensor) -> None:
    if planned != cache.dtype:
        raise ValueError(f"The dtype of paged_kv_cache {cache.dtype} does not match the "
                         f"kv_data_type {planned} specified in plan function.")


def _kv_of(cache: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
           last_page_len: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of sequence b, ``[kv_len, kv_heads, head_dim]`` each."""
    pages = indices[int(indptr[b]):int(indptr[b + 1])].long()
    page_size = cache.shape[2]
    kv_len = (len(pages) - 1) * page_size + int(last_page_len[b])
    kv = cache[pages]  # [n, 2, page_size, kvh, hd]
    k = kv[:, 0].reshape(-1, *cache.shape[3:])[:kv_len]
    v = kv[:, 1].reshape(-1, *cache.shape[3:])[:kv_len]
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool) -> torch.Tensor:
    """q [L, H, D] over k, v [K, KVH, D] in float32; causal aligned to the end of the KV."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, 1)
    vf = v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if causal:
        num_q, num_k = q.shape[0], k.shape[0]
        limit = num_k - num_q + torch.arange(num_q)
        scores = scores.masked_fill(torch.arange(num_k)[None, :] > limit[:, None],
                                    float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        _check_workspace(float_workspace_buffer)
        assert kv_layout == "NHD"
        self.use_cuda_graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                        paged_kv_last_page_len_buffer)
        if use_cuda_graph and any(b is None for b in self.buffers):
            raise ValueError("CUDA graph mode needs the indptr, indices and last_page_len "
                             "buffers")

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
             pos_encoding_mode: str = "NONE", sm_scale: float | None = None,
             q_data_type: Any = torch.float16, kv_data_type: Any = None) -> None:
        PLANS.append({"kind": "decode", "indptr": indptr, "indices": indices,
                      "last_page_len": last_page_len, "tensor_cores": self.use_tensor_cores,
                      "q_data_type": q_data_type, "kv_data_type": kv_data_type})
        self._kv_dtype = kv_data_type or q_data_type
        group = _check_shape(num_qo_heads, num_kv_heads, head_dim)
        if not self.use_tensor_cores and group not in CUDA_CORE_GROUPS:
            raise RuntimeError(f"Unsupported group_size: {group}")
        assert pos_encoding_mode == "NONE"
        if self.use_cuda_graph:
            ind_buf, idx_buf, last_buf = self.buffers
            assert ind_buf is not None and idx_buf is not None and last_buf is not None
            if len(last_page_len) != len(last_buf):
                raise ValueError(f"batch size {len(last_page_len)} differs from the CUDA "
                                 f"graph's {len(last_buf)}")
            ind_buf.copy_(indptr)
            idx_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last_page_len)
            indptr, indices, last_page_len = ind_buf, idx_buf, last_buf
        self._table = (indptr.clone(), indices.clone(), last_page_len.clone())
        self._scale = sm_scale if sm_scale is not None else 1 / math.sqrt(head_dim)

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor, *,
            k_scale: float | None = None, v_scale: float | None = None) -> torch.Tensor:
        _check_dtype(self._kv_dtype, paged_kv_cache)
        indptr, indices, last = self._table
        if q.shape[0] != len(last):
            raise ValueError(f"q has {q.shape[0]} rows for a batch of {len(last)}")
        outs = [_attend(q[b:b + 1], *_kv_of(paged_kv_cache, indptr, indices, last, b),
                        self._scale * (k_scale or 1.0), causal=False) for b in range(len(last))]
        return torch.cat(outs) * (v_scale or 1.0)


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 backend: str = "auto") -> None:
        _check_workspace(float_workspace_buffer)
        assert kv_layout == "NHD"

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int, *,
             causal: bool = False, sm_scale: float | None = None,
             q_data_type: Any = torch.float16, kv_data_type: Any = None) -> None:
        PLANS.append({"kind": "prefill", "qo_indptr": qo_indptr, "indptr": paged_kv_indptr,
                      "indices": paged_kv_indices, "last_page_len": paged_kv_last_page_len,
                      "q_data_type": q_data_type, "kv_data_type": kv_data_type})
        self._kv_dtype = kv_data_type or q_data_type
        _check_shape(num_qo_heads, num_kv_heads, head_dim_qk)
        self._table = (qo_indptr.clone(), paged_kv_indptr.clone(), paged_kv_indices.clone(),
                       paged_kv_last_page_len.clone())
        self._causal = causal
        self._scale = sm_scale if sm_scale is not None else 1 / math.sqrt(head_dim_qk)

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor, *,
            k_scale: float | None = None, v_scale: float | None = None) -> torch.Tensor:
        _check_dtype(self._kv_dtype, paged_kv_cache)
        qo, indptr, indices, last = self._table
        outs = []
        for b in range(len(last)):
            k, v = _kv_of(paged_kv_cache, indptr, indices, last, b)
            outs.append(_attend(q[int(qo[b]):int(qo[b + 1])], k, v,
                                self._scale * (k_scale or 1.0), self._causal))
        return torch.cat(outs) * (v_scale or 1.0)


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor,
                          batch_indices: torch.Tensor, positions: torch.Tensor,
                          paged_kv_cache: torch.Tensor, kv_indices: torch.Tensor,
                          kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor,
                          kv_layout: str = "NHD") -> None:
    assert kv_layout == "NHD"
    if append_key.dtype != paged_kv_cache.dtype:  # the kernel writes the cache's type as is
        raise ValueError(f"append_key is {append_key.dtype}, the cache {paged_kv_cache.dtype}")
    page_size = paged_kv_cache.shape[2]
    for i in range(append_key.shape[0]):
        b, pos = int(batch_indices[i]), int(positions[i])
        page = int(kv_indices[int(kv_indptr[b]) + pos // page_size])
        paged_kv_cache[page, 0, pos % page_size] = append_key[i]
        paged_kv_cache[page, 1, pos % page_size] = append_value[i]


page = SimpleNamespace(append_paged_kv_cache=append_paged_kv_cache)
