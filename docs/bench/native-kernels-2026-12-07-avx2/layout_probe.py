"""F.linear on a row-major weight [out, in] and on the same weight stored column-major (what the
loader did with every unpacked weight before 25d516c), bench-50m's four decode shapes, one torch
thread, best of 5; prints the sum over the shapes per dtype and row count.

    python docs/bench/native-kernels-2026-12-07-avx2/layout_probe.py
"""

import time

import torch


def best(fn, n: int = 5) -> float:  # type: ignore[no-untyped-def]
    b = 1e9
    for _ in range(n):
        t = time.perf_counter()
        fn()
        b = min(b, time.perf_counter() - t)
    return b * 1e3


torch.set_num_threads(1)
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for rows in (8, 32):
        tot = [0.0, 0.0]
        for o, i in ((768, 512), (512, 512), (5632, 512), (512, 2816)):
            w = torch.randn(o, i).to(dt)
            wc = w.t().contiguous().t()
            x = torch.randn(rows, i).to(dt)
            tot[0] += best(lambda: torch.nn.functional.linear(x, w))  # noqa: B023
            tot[1] += best(lambda: torch.nn.functional.linear(x, wc))  # noqa: B023
        print(f"{dt} {rows} rows: row-major {tot[0]:.2f} ms, column-major {tot[1]:.2f} ms "
              "(sum of 4 shapes)")
