"""The native decode attention alone against torch's SDPA on the same K/V (2026-12-06 run).

32 sequences x 2 KV heads x 4 query heads, head_dim 64, ragged lengths (L-8..L), one torch
thread, best of 30 on hot data; prints each side's time and its largest error against a
float64 softmax. Run: .venv/bin/python docs/bench/native-kernels-2026-12-06/attention_microbench.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.attention import cpu_decode


def best_ms(fn: Callable[[], torch.Tensor], n: int = 30) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    torch.set_num_threads(1)
    kernel = cpu_decode.load("on")
    assert kernel is not None
    b, h, g, d = 32, 2, 4, 64
    for dtype in (torch.bfloat16, torch.float32):
        for keys in (158, 512, 1024):
            gen = torch.Generator().manual_seed(0)
            kv = torch.randn(2, b, keys + 64, h * d, generator=gen).to(dtype)
            q = torch.randn(b, h, g, d, generator=gen).to(dtype)
            lens = torch.randint(keys - 8, keys + 1, (b,), generator=gen)
            lens[0] = keys
            scale = d ** -0.5
            kvv = kv[:, :, :keys].view(2, b, keys, h, d).transpose(2, 3)
            mask = (torch.arange(keys)[None, :] < lens[:, None])[:, None, None, :]

            def sdpa(q=q, kvv=kvv, mask=mask, scale=scale) -> torch.Tensor:  # type: ignore[no-untyped-def]
                return F.scaled_dot_product_attention(q, kvv[0], kvv[1], attn_mask=mask,
                                                      scale=scale)

            def native(q=q, kv=kv, lens=lens, scale=scale) -> torch.Tensor:  # type: ignore[no-untyped-def]
                return kernel(q, kv, lens, scale)

            s = (q.double() @ kvv[0].double().transpose(-1, -2)) * scale
            exact = s.masked_fill(~mask, -1e300).softmax(-1) @ kvv[1].double()
            err_native = (native().double() - exact).abs().max().item()
            err_sdpa = (sdpa().double() - exact).abs().max().item()
            print(f"{dtype} {keys} keys: sdpa {best_ms(sdpa):.3f} ms, native "
                  f"{best_ms(native):.3f} ms; max error native {err_native:.2e}, "
                  f"sdpa {err_sdpa:.2e}")


if __name__ == "__main__":
    main()
