"""Sparse MoE MLP (Mixtral, Qwen2-MoE): batched top-k routing, then one matmul per expert.

Expert weights are stacked so a layer is three tensors, whatever the number of experts:

    w13 : [num_experts, 2 * inter, hidden]   rows [gate | up] of each expert
    w2  : [num_experts, hidden, inter]

Tokens are sorted by expert once. On CPU the loop runs over experts (a handful), never over
tokens; it needs each expert's count on the host. On CUDA that would be a host sync in every
layer, so there (in bfloat16, what its grouped GEMM takes) the sorted rows go through
``torch._grouped_mm`` with the experts' row offsets kept on the device (one grouped GEMM per
projection, no sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.config import MoeConfig
from pdserve.models.layers import GatedMLP, Linear, UsesKernels, empty_param


def _grouped(x_sorted: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
             ) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``x_sorted`` times ``weight[e]^T`` ([E, out, in])."""
    return torch._grouped_mm(x_sorted, weight.transpose(1, 2), offs=offsets)


class SparseMoe(nn.Module, UsesKernels):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(hidden_size, moe.num_experts)
        self.w13 = empty_param(moe.num_experts, 2 * moe.intermediate_size, hidden_size)
        self.w2 = empty_param(moe.num_experts, hidden_size, moe.intermediate_size)
        self.grouped: bool | None = None  # None: grouped on CUDA in bf16, else per expert
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_intermediate_size:
            # Qwen2-MoE: an always-on expert, scaled per token by a sigmoid gate.
            self.shared_expert = GatedMLP(hidden_size, moe.shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts per token and their weights ([T, k] each), softmax in float32."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()  # [T * k], slot s belongs to token s // k
        order = flat.argsort(stable=True)
        token_of_slot = order // self.top_k
        # Not bincount: on CUDA it reads the largest id back to the host to size its output.
        counts = torch.zeros(self.w13.shape[0], dtype=torch.long, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        x_sorted = x[token_of_slot]
        grouped = x.is_cuda and x.dtype == torch.bfloat16  # what CUDA's grouped GEMM takes
        if grouped if self.grouped is None else self.grouped:
            offsets = counts.cumsum(0).to(torch.int32)
            hidden = self.kernels.silu_and_mul(_grouped(x_sorted, self.w13, offsets))
            out_sorted = _grouped(hidden, self.w2, offsets)
        else:
            out_sorted = self._per_expert(x_sorted, counts.tolist())
        out_sorted *= weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, token_of_slot, out_sorted)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _per_expert(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out_sorted = torch.empty_like(x_sorted)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            xs = x_sorted[start : start + count]
            hidden = self.kernels.silu_and_mul(F.linear(xs, self.w13[expert]))
            out_sorted[start : start + count] = F.linear(hidden, self.w2[expert])
            start += count
        return out_sorted
