"""A cache-less AttentionBackend for one sequence: causal SDPA over the step's own tokens.

Enough to test the model layer against transformers; the paged backends live in the engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionBackend, AttentionMetadata


class DenseCausalBackend(AttentionBackend):
    def __init__(self) -> None:
        self.calls: list[int] = []  # layer ids, to check every layer attends once

    def prepare(self, metadata: AttentionMetadata) -> None:
        if metadata.num_seqs != 1:
            raise ValueError("DenseCausalBackend handles exactly one sequence")

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.calls.append(layer_id)
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        # [T, H, D] -> [H, T, D] for SDPA, back to [T, H, D].
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)
