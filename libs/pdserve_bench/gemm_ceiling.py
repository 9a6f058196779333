"""The GEMM ceiling of a decode step: the model's own matrix multiplies alone.

One decode step at ``n`` sequences runs, per layer, the fused QKV, O, fused gate/up and down
projections on ``n`` rows, then the LM head. ``gemm_step_seconds`` calls exactly those
modules of the loaded model (so the same weights, packing, dtype and torch threads as the
engine) on random ``[n, in]`` inputs, back to back, with nothing else: no attention, norms,
RoPE, sampling or scheduling. A decode step can only approach this time; the bench reports
the step as a fraction of it (``gemm time / step time``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.models.decoder import DecoderLM
from pdserve.models.layers import Attention, GatedMLP, Linear


def decode_gemms(model: DecoderLM) -> list[Linear]:
    """The projections of one decode step, in order (layers with a sparse MoE have none)."""
    mods: list[Linear] = []
    for layer in model.layers:
        attn = layer.self_attn
        assert isinstance(attn, Attention)
        mods += [attn.qkv_proj, attn.o_proj]
        if isinstance(layer.mlp, GatedMLP):
            mods += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return mods


@torch.inference_mode()
def gemm_step_seconds(model: DecoderLM, num_rows: int, iters: int = 10,
                      clock: Callable[[], float] = time.perf_counter) -> float:
    """Best-of-``iters`` seconds of one step's GEMMs at ``num_rows`` rows (after 2 warm-ups),
    by ``clock`` (wall time; ``time.process_time`` gives this process's CPU time)."""
    mods = decode_gemms(model)
    dtype = model.embed_tokens.dtype
    inputs = [torch.randn(num_rows, m.weight.shape[1]).to(dtype) for m in mods]
    head_in = torch.randn(num_rows, model.config.hidden_size).to(dtype)
    best = float("inf")
    for i in range(iters + 2):
        t0 = clock()
        for mod, x in zip(mods, inputs, strict=True):
            mod(x)
        model.compute_logits(head_in)
        if i >= 2:
            best = min(best, clock() - t0)
    return best


def cpu_features() -> dict[str, Any]:
    """The CPU and the flags that decide which GEMM kernels run (``cluster_bench``'s
    detection from /proc/cpuinfo), the torch threads and the 1-minute load average."""
    from pdserve_bench.cluster_bench import hardware

    found = {k: v for k, v in hardware().items() if k != "link"}
    return found | {"torch_threads": torch.get_num_threads(),
                    "load_average": round(os.getloadavg()[0], 2)}
