"""EngineArgs: every knob of one engine instance, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.attention import BACKENDS

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineArgs:
    """block_size: tokens per KV page (= wire block). num_blocks: pages in the cache; when None
    it is derived from kv_cache_memory_bytes. max_num_batched_tokens: per-step token budget,
    i.e. the chunk size of chunked prefill. max_model_len: None = the model's context."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device {self.device!r} is not a valid torch device: {e}") from e
