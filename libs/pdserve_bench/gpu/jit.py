"""FlashInfer's kernels for the device check, compiled up front in one parallel build.

    python -m pdserve_bench.gpu.jit

FlashInfer compiles a module the first time a wrapper plans it; the check needs several
(paged decode for head_dim 64 and 128, the prefill module for both, which the tensor-core
decode also uses, page append, norm, SiLU-and-mul, RoPE). Building them all in one ninja run
uses every core at once, while the float32 parts of the check run (they need none of them).
The modules land in FlashInfer's cache, where the wrappers find them.
"""

from __future__ import annotations

import sys
import time

import torch

HEAD_DIMS = (64, 128)


def specs() -> list[object]:
    from flashinfer.jit import activation, norm, page, rope
    from flashinfer.jit.attention import modules

    bf16, i32 = torch.bfloat16, torch.int32
    out: list[object] = [page.gen_page_module(), norm.gen_norm_module(),
                         activation.gen_act_and_mul_module("silu"), rope.gen_rope_module()]
    for hd in HEAD_DIMS:
        out.append(modules.gen_batch_decode_module(bf16, bf16, bf16, i32, hd, hd, 0, False,
                                                   False))
        out.append(modules.gen_batch_prefill_module("fa2", bf16, bf16, bf16, i32, hd, hd, 0,
                                                    False, False, False))
    return out


def main() -> int:
    from flashinfer.jit.core import build_jit_specs

    t0 = time.perf_counter()
    build_jit_specs(specs(), verbose=False)  # type: ignore[arg-type]
    print(f"flashinfer jit: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
