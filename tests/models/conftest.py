"""Fixtures for the model-layer tests: reference models built with transformers, saved as
Hugging Face directories next to the built-in tokenizer, and a forward helper."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pdserve.models import CausalLM, save_builtin

from .dense_backend import DenseCausalBackend

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="session")
def builtin_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``tiny`` and ``tiny-moe`` written by save_builtin (seed 0), once per session."""
    root = tmp_path_factory.mktemp("builtin")
    return {name: save_builtin(name, root / name) for name in ("tiny", "tiny-moe")}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with std 1/sqrt(fan_in) (so logits are O(1) and a wrong layer shows), biases
    non-zero, norm weights near 1: transformers' own init leaves biases at zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def save_reference(model: transformers.PreTrainedModel, directory: Path, tokenizer_dir: Path,
                   **save_kwargs: Any) -> Path:
    model.save_pretrained(directory, **save_kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@torch.no_grad()
def pdserve_logits(model: CausalLM, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + len(ids), device=ids.device)
    backend = DenseCausalBackend()
    hidden = model(ids, positions, backend)
    assert backend.calls == list(range(model.config.num_layers))
    return model.compute_logits(hidden)


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + len(ids))[None]
    return model(ids[None], position_ids=positions).logits[0].float()
