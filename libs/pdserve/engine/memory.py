"""How many KV blocks an engine gets: fixed, from a byte budget (CPU), or on CUDA from the share
of device memory it may use, after its weights and the activations of a full step (vLLM's
method: run the largest step once on a throwaway cache and read the allocator's peak).

    device memory (total)
    |<---------------- gpu_memory_utilization * total ---------------->|
    | weights | peak activations of one step | CUDA context, libraries | KV cache ... |

Only this process's own usage counts against its share (several engines may share a GPU,
each with its fraction); the KV cache never takes more than what is free right now.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Memory outside torch's allocator (CUDA context, cuBLAS and FlashInfer modules) and headroom
# for allocator fragmentation: kept free on top of the measured peak.
NON_TORCH_BYTES = 1 << 30


@dataclass(frozen=True)
class GpuBudget:
    """What sizing the KV cache saw on the device (bytes), for the log line and tests."""

    total: int
    free: int
    peak_allocated: int
    kv_bytes: int


def kv_bytes_for(total: int, free: int, peak_allocated: int, reserved_unused: int,
                 utilization: float) -> int:
    """Bytes the KV cache may take: this engine's share minus what it already needs at its
    peak (and the non-torch reserve), never more than is free now (plus what torch holds
    cached but unused)."""
    share = int(total * utilization) - peak_allocated - NON_TORCH_BYTES
    return max(0, min(share, free + reserved_unused - NON_TORCH_BYTES // 4))


def measure_gpu_budget(device: torch.device, utilization: float,
                       profile_step: Callable[[], None]) -> GpuBudget:
    """Run ``profile_step`` (the largest step on a throwaway cache) and size the KV cache."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    kv = kv_bytes_for(total, free, peak, unused, utilization)
    return GpuBudget(total=total, free=free, peak_allocated=peak, kv_bytes=kv)


def num_blocks_for(kv_bytes: int, bytes_per_block: int, what: str) -> int:
    """Whole blocks in ``kv_bytes``; ValueError naming ``what`` when not even one fits."""
    num = kv_bytes // bytes_per_block
    if num < 1:
        raise ValueError(f"{what}: no room for a single KV block ({bytes_per_block} bytes); "
                         f"{kv_bytes} bytes are left for the KV cache")
    return num
