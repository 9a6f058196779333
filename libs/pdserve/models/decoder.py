"""One decoder for Llama, Mistral, Qwen2, Mixtral and Qwen2-MoE: they differ only in biases,
tied embeddings and the MLP kind, all read from ModelConfig."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.attention.base import AttentionBackend
from pdserve.models.base import CausalLM
from pdserve.models.config import ModelConfig
from pdserve.models.kernels import Kernels, kernels_for
from pdserve.models.layers import Attention, GatedMLP, RMSNorm, UsesKernels, empty_param
from pdserve.models.moe import SparseMoe
from pdserve.models.packed import PackedWeight
from pdserve.models.rope import Rotary
from pdserve.models.weights import WeightRouter


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        moe = config.moe
        if moe is not None and layer_id not in moe.dense_layers:
            self.mlp = SparseMoe(config.hidden_size, moe)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Any,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (its MLP's), not yet added to ``residual``, the
        stream; returns this layer's (output, stream) the same way."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class DecoderLM(CausalLM, UsesKernels):
    """Parameter names mirror the Hugging Face ones minus the ``model.`` prefix, except for
    fused tensors (``qkv_proj``, ``gate_up_proj``, expert ``w13``/``w2``); see weights.py."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = empty_param(config.vocab_size, config.hidden_size)
        self.rotary = Rotary(config.rope, config.head_dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else empty_param(
            config.vocab_size, config.hidden_size
        )
        self.lm_head_packed: PackedWeight | None = None  # set at load on CPU

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed_tokens)
        rope = self.kernels.rope_inputs(self.rotary, positions, h.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, attn)
        return self.norm(h) if residual is None else self.norm.add_forward(h, residual)[0]

    def select_kernels(self, max_positions: int, native: str = "off") -> str:
        weight = self.embed_tokens
        kernels = kernels_for(self.rotary, max_positions, weight.device, weight.dtype, native)
        self.use_kernels(kernels)
        return kernels.name

    def use_kernels(self, kernels: Kernels) -> None:
        """Run every norm, RoPE and SiLU-and-mul of the model on ``kernels``."""
        for module in self.modules():
            if isinstance(module, UsesKernels):
                module.kernels = kernels

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_packed is not None:
            return self.lm_head_packed.linear(hidden, None).float()
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        router = WeightRouter(self.config, dict(self.named_parameters()))
        for name, tensor in weights:
            router.load(name, tensor)
        router.check_complete()
