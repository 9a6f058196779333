"""Attention backends, imported lazily so CPU code never imports FlashInfer or touches CUDA.

    get_backend("auto" | "torch" | "flashinfer", kv_caches=[...], num_qo_heads=..., scale=...,
                kv_scales=[...] for a quantized (fp8/int8) cache, q_dtype=the model's dtype,
                native="auto" | "on" | "off": the torch backend's CPU decode kernel)

"auto" picks FlashInfer only when the cache lives on CUDA in float16/bfloat16, the package is
installed and FlashInfer dispatches the shape (head_dim, query heads per KV head); otherwise
the torch backend, saying why in one log line. "flashinfer" asked for explicitly fails with
that reason instead.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata
from pdserve.attention.cpu_decode import DecodeKernel

BACKENDS = ("auto", "torch", "flashinfer")

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "flashinfer_unsupported",
           "get_backend", "native_decode", "resolve_backend"]

log = logging.getLogger(__name__)


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The concrete backend ``name`` means on ``device`` ("torch" or "flashinfer")."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    is_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        has_fi = is_cuda and importlib.util.find_spec("flashinfer") is not None
        return "flashinfer" if has_fi else "torch"
    if name == "flashinfer" and not is_cuda:
        raise ValueError("attention_backend 'flashinfer' needs a CUDA device, got "
                         f"{torch.device(device)}")
    return name


def flashinfer_unsupported(kv_cache: torch.Tensor, num_qo_heads: int | None,
                           q_dtype: torch.dtype | None = None) -> str | None:
    """Why FlashInfer cannot serve this cache and head count (None: it can). Pure shape
    checks: nothing of FlashInfer is imported."""
    from pdserve.attention.flashinfer_backend import unsupported_reason

    if num_qo_heads is None:
        return "num_qo_heads is required for the flashinfer backend"
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    return unsupported_reason(head_dim, num_qo_heads, num_kv_heads, q_dtype or kv_cache.dtype,
                              kv_cache.dtype)


def get_backend(name: str, kv_caches: list[torch.Tensor], num_qo_heads: int | None = None,
                scale: float | None = None, kv_scales: list[torch.Tensor] | None = None,
                q_dtype: torch.dtype | None = None, mirror_bytes: int | None = None,
                native: str = "off") -> AttentionBackend:
    """Build the backend over per-layer caches ``[pages, 2, page_size, kv_heads, head_dim]``
    (and, quantized, their scales ``[pages, 2, page_size, kv_heads]``). ``mirror_bytes``: the
    most the torch backend's decode mirror may hold (``decode_mirror.py``; None: its default,
    0: none). ``native``: the torch backend's CPU decode kernel, "auto" | "on" | "off"
    (``cpu_decode.py``)."""
    if not kv_caches:
        raise ValueError("kv_caches must hold one tensor per layer")
    resolved = resolve_backend(name, kv_caches[0].device)
    if resolved == "flashinfer":
        reason = flashinfer_unsupported(kv_caches[0], num_qo_heads, q_dtype)
        if reason is not None and name == "flashinfer":
            raise ValueError(f"attention_backend 'flashinfer' cannot serve this model: {reason}")
        if reason is not None:
            log.info("attention backend: torch, not flashinfer",
                     extra={"fields": {"reason": reason}})
            resolved = "torch"
    if resolved == "flashinfer":
        from pdserve.attention.flashinfer_backend import FlashInferBackend

        assert num_qo_heads is not None
        return FlashInferBackend(kv_caches, num_qo_heads=num_qo_heads, scale=scale,
                                 q_dtype=q_dtype)
    from pdserve.attention.torch_backend import TorchBackend

    return TorchBackend(kv_caches, scale=scale, kv_scales=kv_scales, mirror_bytes=mirror_bytes,
                        native=native_decode(native, kv_caches[0], num_qo_heads, q_dtype))


def native_decode(mode: str, kv_cache: torch.Tensor, num_qo_heads: int | None,
                  q_dtype: torch.dtype | None) -> DecodeKernel | None:
    """The CPU decode kernel for this cache under ``mode`` (None: SDPA serves); "on" raises
    ValueError where it cannot serve, naming why."""
    from pdserve.attention import cpu_decode

    if mode not in cpu_decode.MODES:
        raise ValueError(f"native_kernels must be one of {cpu_decode.MODES}, got {mode!r}")
    if mode == "off":
        return None
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    reason = ("the cache is not on the CPU" if kv_cache.device.type != "cpu" else
              cpu_decode.serves(head_dim, num_qo_heads or num_kv_heads, num_kv_heads,
                                q_dtype or kv_cache.dtype))
    if reason is not None:
        if mode == "on":
            raise ValueError(f"native_kernels 'on' cannot serve this model: {reason}")
        log.info("decode attention: torch SDPA, not the native kernel",
                 extra={"fields": {"reason": reason}})
        return None
    return cpu_decode.load(mode)
