"""Putting one engine on its device: kernels, KV cache size, attention backend, CUDA graphs.

    select_kernels    FlashInfer's fused norm / RoPE / SiLU on CUDA in half precision
    size the cache    num_blocks, or a byte budget (CPU), or measured (CUDA, engine/memory.py)
    cache + backend   [layers, pages, 2, block, kv_heads, head_dim] (+ scales when the KV
                      cache dtype is fp8/int8); "auto" -> FlashInfer where it serves, torch
                      elsewhere
    CUDA graphs       decode steps captured for a ladder of batch sizes (FlashInfer only); the
                      cache then has one page more, the graphs' scratch page

Everything here runs once, at engine construction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.attention import AttentionBackend, cpu_decode, get_backend
from pdserve.attention.base import AttentionMetadata
from pdserve.attention.decode_mirror import MAX_BYTES as MIRROR_MAX_BYTES
from pdserve.attention.flashinfer_backend import FlashInferBackend
from pdserve.attention.kv_quant import kv_quant
from pdserve.attention.torch_backend import TorchBackend
from pdserve.engine.config import EngineArgs, check_device
from pdserve.engine.cuda_graphs import DecodeGraphs, try_capture
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.memory import measure_gpu_budget, num_blocks_for
from pdserve.engine.sampler import Argmax, torch_argmax

if TYPE_CHECKING:
    from pdserve.models import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    device: torch.device
    num_blocks: int
    cache: PagedKVCache
    backend: AttentionBackend
    graphs: DecodeGraphs | None
    kernels: str
    argmax: Argmax  # the sampler's (the native kernel's on a CPU engine where it runs)


def build_parts(lm: LoadedModel, args: EngineArgs, max_model_len: int) -> EngineParts:
    cfg = lm.config
    device = check_device(args.device)
    kernels = lm.model.select_kernels(max_model_len, args.native_kernels)
    quant = kv_quant(args.kv_cache_dtype)
    per_block = PagedKVCache.bytes_per_block(cfg.num_layers, args.block_size, cfg.num_kv_heads,
                                             cfg.head_dim, cfg.dtype, quant)
    if args.num_blocks:
        num_blocks = args.num_blocks
    elif device.type == "cuda":
        budget = measure_gpu_budget(device, args.gpu_memory_utilization,
                                    lambda: profile_step(lm, args, device, max_model_len))
        num_blocks = num_blocks_for(budget.kv_bytes, per_block, "gpu_memory_utilization")
        log.info("KV cache sized from device memory", extra={"fields": {
            "num_blocks": num_blocks, "total_gib": round(budget.total / 2**30, 1),
            "peak_gib": round(budget.peak_allocated / 2**30, 2),
            "utilization": args.gpu_memory_utilization}})
    else:
        num_blocks = max(1, args.kv_cache_memory_bytes // per_block)
    mirror_bytes = args.decode_mirror_memory_bytes
    if mirror_bytes is None:
        mirror_bytes = min(num_blocks * per_block, MIRROR_MAX_BYTES)
    use_graphs = device.type == "cuda" and args.cuda_graphs
    cache = PagedKVCache(cfg.num_layers, num_blocks + int(use_graphs), args.block_size,
                         cfg.num_kv_heads, cfg.head_dim, cfg.dtype, device, quant)
    backend = get_backend(args.attention_backend, cache.layers, cfg.num_heads,
                          kv_scales=cache.layer_scales, q_dtype=cfg.dtype,
                          mirror_bytes=mirror_bytes, native=args.native_kernels)
    if isinstance(backend, TorchBackend):
        log.info("KV memory", extra={"fields": {
            "num_blocks": num_blocks, "cache_mib": round(num_blocks * per_block / 2**20, 1),
            "decode_mirror_max_mib": round(backend.mirror.max_bytes / 2**20, 1),
            "decode_attention": "native" if backend.native else "sdpa",
            "packed_gemm": packed_gemms(lm.model)}})
    cache.unit_scales = quant is not None and isinstance(backend, FlashInferBackend)
    graphs = None
    if use_graphs and isinstance(backend, FlashInferBackend):
        graphs = try_capture(DecodeGraphs(lm.model, backend, args.max_num_seqs,
                                          scratch_page=num_blocks,
                                          num_pages=num_blocks + 1, device=device))
    argmax = cpu_decode.argmax(args.native_kernels) if device.type == "cpu" else None
    return EngineParts(device, num_blocks, cache, backend, graphs, kernels,
                       argmax or torch_argmax)


def packed_gemms(model: torch.nn.Module) -> str:
    """Whose packed GEMMs the model's projections run (``models/packed.py``: "mkl",
    "onednn", both), or "none"."""
    from pdserve.models.layers import Linear

    kinds = {m.packed.kind for m in model.modules() if isinstance(m, Linear) and m.packed}
    return ",".join(sorted(kinds)) or "none"


@torch.inference_mode()
def profile_step(lm: LoadedModel, args: EngineArgs, device: torch.device,
                 max_model_len: int) -> None:
    """The largest step the scheduler can make (one chunk of max_num_batched_tokens, logits
    for max_num_seqs rows) on a throwaway cache just big enough for it."""
    cfg = lm.config
    num_tokens = min(args.max_num_batched_tokens, max_model_len)
    num_pages = -(-num_tokens // args.block_size)
    cache = PagedKVCache(cfg.num_layers, num_pages, args.block_size, cfg.num_kv_heads,
                         cfg.head_dim, cfg.dtype, device, kv_quant(args.kv_cache_dtype))
    backend = get_backend(args.attention_backend, cache.layers, cfg.num_heads,
                          kv_scales=cache.layer_scales, q_dtype=cfg.dtype)
    backend.prepare(AttentionMetadata(
        qo_indptr=torch.tensor([0, num_tokens], dtype=torch.int32),
        page_table=[list(range(num_pages))],
        kv_lens=torch.tensor([num_tokens], dtype=torch.int32),
        slot_mapping=torch.arange(num_tokens), is_decode_only=num_tokens == 1))
    positions = torch.arange(num_tokens, device=device)
    hidden = lm.model(torch.zeros(num_tokens, dtype=torch.long, device=device), positions,
                      backend)
    lm.model.compute_logits(hidden[: min(args.max_num_seqs, num_tokens)])
