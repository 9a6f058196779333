"""Building blocks shared by every architecture: flat ``[T, ...]`` tensors, no batch dim.

Parameters are allocated with ``torch.empty`` (no random init): the loader or the built-in
generator fills every one of them, and checks that none was left out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.attention.base import AttentionBackend
from pdserve.models.config import ModelConfig
from pdserve.models.rope import apply_rope


def empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). W is ``[out, in]`` like ``nn.Linear``; rows of fused layers are stacked."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_param(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 then cast back before the weight, as the reference does, so
        # bfloat16 runs round the same way.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """Fused qkv projection -> RoPE -> backend (which owns the KV cache) -> output projection."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.sizes = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = Linear(config.hidden_size, sum(self.sizes), config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, config.o_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        # Backends may scatter v into a cache or hand it to a kernel: give them dense memory.
        v = v.contiguous().view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attn.forward(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(num_tokens, -1))


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
