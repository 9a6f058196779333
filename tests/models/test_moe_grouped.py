"""The MoE's sync-free grouped-GEMM path (the one CUDA takes) against its per-expert loop."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.config import MoeConfig
from pdserve.models.moe import SparseMoe


@pytest.mark.parametrize("shared", [0, 48])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_grouped_gemm_path_matches_the_expert_loop(shared: int, num_tokens: int) -> None:
    g = torch.Generator().manual_seed(num_tokens + shared)
    moe = SparseMoe(32, MoeConfig(num_experts=6, top_k=2, intermediate_size=40,
                                  norm_topk_prob=True, shared_intermediate_size=shared))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(num_tokens, 32, generator=g)
    moe.grouped = False
    expect = moe(x)
    moe.grouped = True
    torch.testing.assert_close(moe(x), expect, atol=1e-5, rtol=1e-5)
