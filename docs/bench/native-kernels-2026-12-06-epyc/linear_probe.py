"""F.linear (what transformers runs) against pdserve's prepacked weight, on the bench-50m
shapes at 32 rows, float32 and bfloat16; one thread, best of 50 on hot data.
Run: .venv/bin/python docs/bench/native-kernels-2026-12-06-epyc/linear_probe.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.models.packed import pack

SHAPES = ((1536, 512), (5632, 512), (512, 2816))  # (out, in): qkv, gate_up, down


def best_ms(fn: Callable[[], torch.Tensor], n: int = 50) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for n_out, n_in in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(n_out, n_in).to(dtype)
            x = torch.randn(32, n_in).to(dtype)
            packed = pack(w)
            plain_ms = best_ms(lambda x=x, w=w: F.linear(x, w))
            packed_ms = (best_ms(lambda x=x, p=packed: p.linear(x, None)) if packed is not None
                         else float("nan"))
            print(f"{str(dtype):15s} [32,{n_in}]x[{n_in},{n_out}]: F.linear {plain_ms:.3f} ms, "
                  f"packed {packed_ms:.3f} ms")


if __name__ == "__main__":
    main()
