"""Part c: FlashInfer decode attention's achieved bandwidth vs the device's copy bandwidth.

32 sequences of 4096 cached tokens each, Llama-3-8B's attention shape (32 query heads on 8 KV
heads, head_dim 128, bfloat16, 16-token pages in a shuffled page order), one layer; the kernel
reads every K and V byte once. Copy bandwidth: one device-to-device copy of 1 GiB, counting the
bytes read and written. Both are the best of the timed repetitions (CUDA events).
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.attention.base import AttentionMetadata
from pdserve.attention.flashinfer_backend import FlashInferBackend

TARGET = 0.70
NUM_SEQS, CONTEXT, PAGE, KV_HEADS, Q_HEADS, HEAD_DIM = 32, 4096, 16, 8, 32, 128


def _best_ms(fn: Any, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes per second through device memory (read + write) of one large copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (_best_ms(lambda: dst.copy_(src), reps) / 1e3)


def attention_bandwidth(device: torch.device, reps: int = 50) -> tuple[float, int, float]:
    """(bytes per second, KV bytes per call, ms per call) of the decode kernel alone."""
    pages_per_seq = CONTEXT // PAGE
    num_pages = NUM_SEQS * pages_per_seq
    g = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn(num_pages, 2, PAGE, KV_HEADS, HEAD_DIM, generator=g, device=device,
                        dtype=torch.bfloat16)
    order = torch.randperm(num_pages).tolist()
    tables = [order[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(NUM_SEQS)]
    backend = FlashInferBackend([cache], num_qo_heads=Q_HEADS)
    backend.prepare(AttentionMetadata(
        torch.arange(NUM_SEQS + 1, dtype=torch.int32), tables,
        torch.full((NUM_SEQS,), CONTEXT, dtype=torch.int32),
        torch.zeros(NUM_SEQS, dtype=torch.long), True))
    q = torch.randn(NUM_SEQS, Q_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    wrapper = backend._wrapper
    ms = _best_ms(lambda: wrapper.run(q, cache), reps)
    kv_bytes = cache.numel() * cache.element_size()
    return kv_bytes / (ms / 1e3), kv_bytes, ms


def check(device: torch.device) -> dict[str, Any]:
    copy_bps = copy_bandwidth(device)
    attn_bps, kv_bytes, ms = attention_bandwidth(device)
    fraction = attn_bps / copy_bps
    return {"shape": f"{NUM_SEQS} seqs x {CONTEXT} tokens, {Q_HEADS}q/{KV_HEADS}kv heads, "
                     f"head_dim {HEAD_DIM}, bf16, page {PAGE}",
            "kv_bytes_per_call": kv_bytes, "attention_ms": ms,
            "attention_gb_s": attn_bps / 1e9, "copy_gb_s": copy_bps / 1e9,
            "fraction_of_copy": fraction, "target": f">= {TARGET:.0%} of copy bandwidth",
            "ok": fraction >= TARGET}
