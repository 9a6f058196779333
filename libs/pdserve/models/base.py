"""The CausalLM contract every architecture implements (the engine sees nothing else)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from pdserve.attention.base import AttentionBackend
from pdserve.models.config import ModelConfig


class CausalLM(nn.Module, ABC):
    """``forward`` runs a flat batch of T tokens (several sequences, each token with its own
    position) and returns the final-normed hidden states; ``compute_logits`` projects the
    rows the sampler needs. Attention and its KV cache live behind ``attn``."""

    config: ModelConfig

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> float32 logits [N, vocab_size]."""

    def select_kernels(self, max_positions: int, native: str = "off") -> str:
        """Pick the elementwise kernels for the model's device and dtype (positions up to
        ``max_positions``; ``native``: pdserve's C++ CPU kernels, "auto" | "on" | "off");
        returns their name. The default: plain torch."""
        return "torch"

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters; raise naming any missing or
        unexpected tensor."""
