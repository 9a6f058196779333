"""Building blocks shared by every architecture: flat ``[T, ...]`` tensors, no batch dim.

Parameters are allocated with ``torch.empty`` (no random init): the loader or the built-in
generator fills every one of them, and checks that none was left out. Modules that run
elementwise kernels (norms, RoPE, SiLU-and-mul) are ``UsesKernels``: the loader hands them
FlashInfer's fused ones on CUDA (``models/kernels.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.attention.base import AttentionBackend
from pdserve.models.config import ModelConfig
from pdserve.models.kernels import TORCH_KERNELS, Kernels
from pdserve.models.packed import PackedWeight


def empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). W is ``[out, in]`` like ``nn.Linear``; rows of fused layers are stacked."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None
        self.packed: PackedWeight | None = None  # set at load on CPU (models/packed.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.linear(x, self.bias)
        return F.linear(x, self.weight, self.bias)


class UsesKernels:
    """A module whose elementwise work goes through ``self.kernels`` (torch by default)."""

    kernels: Kernels = TORCH_KERNELS


class RMSNorm(nn.Module, UsesKernels):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_param(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add, fused on CUDA."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module, UsesKernels):
    """Fused qkv projection -> RoPE -> backend (which owns the KV cache) -> output projection."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.sizes = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = Linear(config.hidden_size, sum(self.sizes), config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, config.o_bias)

    def forward(self, x: torch.Tensor, rope: Any, attn: AttentionBackend) -> torch.Tensor:
        """``rope``: what ``kernels.rope_inputs`` made of this step's positions."""
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.sizes[0] + self.sizes[1], self.sizes[2]], dim=-1)
        q, k = self.kernels.rope_qk(
            qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim),
            self.num_heads, rope)
        # Backends may scatter v into a cache or hand it to a kernel: give them dense memory.
        v = v.contiguous().view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attn.forward(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(num_tokens, -1))


class GatedMLP(nn.Module, UsesKernels):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))
