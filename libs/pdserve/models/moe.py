"""Sparse MoE MLP (Mixtral, Qwen2-MoE): batched top-k routing, then one matmul per expert.

Expert weights are stacked so a layer is three tensors, whatever the number of experts:

    w13 : [num_experts, 2 * inter, hidden]   rows [gate | up] of each expert
    w2  : [num_experts, hidden, inter]

Tokens are sorted by expert once; the loop runs over experts (a handful), never over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.config import MoeConfig
from pdserve.models.layers import GatedMLP, Linear, empty_param


class SparseMoe(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(hidden_size, moe.num_experts)
        self.w13 = empty_param(moe.num_experts, 2 * moe.intermediate_size, hidden_size)
        self.w2 = empty_param(moe.num_experts, hidden_size, moe.intermediate_size)
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
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        x_sorted = x[token_of_slot]
        out_sorted = torch.empty_like(x_sorted)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            xs = x_sorted[start : start + count]
            gate, up = F.linear(xs, self.w13[expert]).chunk(2, dim=-1)
            out_sorted[start : start + count] = F.linear(F.silu(gate) * up, self.w2[expert])
            start += count
        out_sorted *= weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, token_of_slot, out_sorted)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
