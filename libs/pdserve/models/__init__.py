"""The model layer: ModelConfig, the CausalLM contract, and load_model.

    loaded = load_model("tiny")                       # or a local Hugging Face directory
    hidden = loaded.model(input_ids, positions, attn)  # attn: an AttentionBackend
    logits = loaded.model.compute_logits(hidden[last_rows])

Imported lazily: the router reads a model's tokenizer and fingerprint from ``builtin`` and
``files`` without the weights' stack (torch), which its image does not carry.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.models.base import CausalLM
    from pdserve.models.builtin import BUILTIN_MODELS, save_builtin
    from pdserve.models.config import ARCHITECTURES, ModelConfig, MoeConfig, RopeConfig
    from pdserve.models.files import builtin_tokenizer
    from pdserve.models.loader import LoadedModel, load_model

_HOME = {"CausalLM": "base", "BUILTIN_MODELS": "builtin", "save_builtin": "builtin",
         "ARCHITECTURES": "config", "ModelConfig": "config", "MoeConfig": "config",
         "RopeConfig": "config", "builtin_tokenizer": "files", "LoadedModel": "loader",
         "load_model": "loader"}

__all__ = [
    "ARCHITECTURES",
    "BUILTIN_MODELS",
    "CausalLM",
    "LoadedModel",
    "ModelConfig",
    "MoeConfig",
    "RopeConfig",
    "builtin_tokenizer",
    "load_model",
    "save_builtin",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'pdserve.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pdserve.models.{_HOME[name]}"), name)
