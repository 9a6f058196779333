"""EngineArgs: every knob of one engine instance, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.attention import BACKENDS
from pdserve.attention.cpu_decode import MODES as NATIVE_MODES
from pdserve.attention.kv_quant import KV_CACHE_DTYPES
from pdserve.models.packed import FLOAT32_GEMMS

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def check_device(name: str) -> torch.device:
    """The torch device ``name`` names, if this machine has it; ValueError (one line, naming
    the device) otherwise."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {name!r} is not a valid torch device: {e}") from e
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device {name!r}: pdserve runs on cpu or cuda[:N]")
    if torch.version.cuda is None:
        raise ValueError(f"device {name!r}: this torch ({torch.__version__}) is a CPU-only "
                         "build; install a CUDA build of torch and the gpu extra")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"device {name!r}: no CUDA device is visible (check the driver and "
                         "CUDA_VISIBLE_DEVICES)")
    if device.index is not None and device.index >= count:
        raise ValueError(f"device {name!r}: only {count} CUDA device(s) are visible "
                         f"(cuda:0..cuda:{count - 1})")
    return device


@dataclass(frozen=True)
class EngineArgs:
    """block_size: tokens per KV page (= wire block). num_blocks: pages in the cache; when None
    it is derived from memory: ``kv_cache_memory_bytes`` on CPU, on CUDA what
    ``gpu_memory_utilization`` of the device leaves after the weights and the activations of a
    full step (measured). max_num_batched_tokens: per-step token budget, i.e. the chunk size of
    chunked prefill. max_model_len: None = the model's context. dtype "auto": the checkpoint's,
    except float32 checkpoints run in bfloat16 on CUDA. cuda_graphs: capture the decode step
    for a ladder of batch sizes (CUDA with the FlashInfer backend only). kv_cache_dtype: "auto"
    (the model's dtype), "fp8" (e4m3) or "int8", quantized with per-token per-head scales
    (attention/kv_quant.py). packed_weights: pre-pack the CPU GEMM weights at load
    (models/packed.py; faster decode, more weight memory in float32); False keeps only the
    plain weights. float32_gemm: whose packed GEMM serves float32 weights: "mkl" (bit-identical
    to ``F.linear``, so to transformers) or "onednn" (not bit-identical; faster where MKL does
    not run its AVX-512 code, an AMD EPYC). decode_mirror_memory_bytes: the most the torch
    backend's decode mirror (a dense copy of a running decode batch's K/V,
    attention/decode_mirror.py; CPU only) may hold; None = as much as the KV cache itself (so
    K/V memory is at most twice the cache), at most 1 GiB; 0 = no mirror. native_kernels:
    pdserve's C++ CPU kernels (attention/cpu_decode.py, built at first use): the decode
    attention, and in bfloat16 the RMSNorm and SiLU-and-mul; "auto" where the CPU and a C++
    compiler allow, else torch's ops; "on" fails instead; "off" is torch's ops."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    device: str = "cpu"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    packed_weights: bool = True
    float32_gemm: str = "mkl"
    decode_mirror_memory_bytes: int | None = None
    native_kernels: str = "auto"
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
        mirror = self.decode_mirror_memory_bytes
        if mirror is not None and (isinstance(mirror, bool) or not isinstance(mirror, int)
                                   or mirror < 0):
            raise ValueError(f"decode_mirror_memory_bytes must be None or an int >= 0, "
                             f"got {mirror!r}")
        util = self.gpu_memory_utilization
        if not isinstance(util, int | float) or not math.isfinite(util) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.native_kernels not in NATIVE_MODES:
            raise ValueError(f"native_kernels must be one of {NATIVE_MODES}, "
                             f"got {self.native_kernels!r}")
        if self.float32_gemm not in FLOAT32_GEMMS:
            raise ValueError(f"float32_gemm must be one of {FLOAT32_GEMMS}, "
                             f"got {self.float32_gemm!r}")
        if not isinstance(self.packed_weights, bool):
            raise ValueError(f"packed_weights must be a bool, got {self.packed_weights!r}")
        check_device(self.device)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
