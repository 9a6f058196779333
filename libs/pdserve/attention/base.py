"""The attention plug point: every backend reads and writes one paged KV layout.

KV cache of one layer (FlashInfer's NHD paged layout; page size = block size):

    kv_cache[layer] : [num_pages, 2, page_size, num_kv_heads, head_dim]
                                  ^ 0 = K, 1 = V

A forward step runs a flat batch of T new tokens from several sequences. Before the model runs,
the engine calls ``prepare(metadata)``; then every attention layer calls ``forward``, which
(1) writes the new tokens' K and V into their slots and (2) attends each query to the cached
keys of its own sequence plus the new ones, causally.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where the T tokens of one step live, per sequence (all tensors on the cache's device).

    qo_indptr:      [num_seqs + 1] int32, offsets of each sequence's new tokens in the batch.
    page_table:     list per sequence of page ids covering its whole context (cached + new).
    kv_lens:        [num_seqs] int32, context length after this step (cached + new tokens).
    slot_mapping:   [T] int64, flat slot (page * page_size + offset) for each new token.
    is_decode_only: every sequence has exactly one new token (decode kernels may be used).
    seq_ids:        the sequences' request ids, when the caller knows them: a backend may keep
                    per-sequence state across steps (the torch backend's decode mirror).
    """

    qo_indptr: torch.Tensor
    page_table: list[list[int]]
    kv_lens: torch.Tensor
    slot_mapping: torch.Tensor
    is_decode_only: bool
    seq_ids: list[str] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.page_table)


class AttentionBackend(ABC):
    """Contract: ``forward(layer_id, q, k, v)`` with q ``[T, num_heads, head_dim]`` and k, v
    ``[T, num_kv_heads, head_dim]`` returns ``[T, num_heads, head_dim]``. It must store k, v
    at ``metadata.slot_mapping`` of layer ``layer_id`` before attending, support GQA
    (num_heads a multiple of num_kv_heads), and use scale ``1/sqrt(head_dim)`` unless the
    backend was built with another."""

    @abstractmethod
    def prepare(self, metadata: AttentionMetadata) -> None:
        """Plan the next step (build indices/masks once, reused by every layer)."""

    @abstractmethod
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store k, v for the step's tokens and return attention output for q."""
