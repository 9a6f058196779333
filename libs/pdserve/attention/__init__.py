"""Attention backends, imported lazily so CPU code never imports FlashInfer or touches CUDA.

    get_backend("auto" | "torch" | "flashinfer", kv_caches=[...], num_qo_heads=..., scale=...)

"auto" picks FlashInfer only when the cache lives on CUDA in float16/bfloat16 and the package
is installed; otherwise the torch backend.
"""

from __future__ import annotations

import importlib.util

import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata

BACKENDS = ("auto", "torch", "flashinfer")

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "get_backend", "resolve_backend"]


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


def get_backend(name: str, kv_caches: list[torch.Tensor], num_qo_heads: int | None = None,
                scale: float | None = None) -> AttentionBackend:
    """Build the backend over per-layer caches ``[pages, 2, page_size, kv_heads, head_dim]``."""
    if not kv_caches:
        raise ValueError("kv_caches must hold one tensor per layer")
    resolved = resolve_backend(name, kv_caches[0].device)
    if name == "auto" and kv_caches[0].dtype not in (torch.float16, torch.bfloat16):
        resolved = "torch"  # FlashInfer kernels are half precision only
    if resolved == "flashinfer":
        from pdserve.attention.flashinfer_backend import FlashInferBackend

        if num_qo_heads is None:
            raise ValueError("num_qo_heads is required for the flashinfer backend")
        return FlashInferBackend(kv_caches, num_qo_heads=num_qo_heads, scale=scale)
    from pdserve.attention.torch_backend import TorchBackend

    return TorchBackend(kv_caches, scale=scale)
