"""What the router needs to know about the model: its tokenizer, fingerprint and context length.

A router never needs the weights: it tokenizes, renders chat templates and hashes blocks with
the model's fingerprint (the same one engines and kvd use, or no prefix would ever match).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class TextTokenizer(Protocol):
    """The part of ``pdserve.tokenizer.Tokenizer`` the router uses."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class ModelSpec:
    name: str
    fingerprint: str
    max_context: int
    tokenizer: TextTokenizer | None = None  # None: only prompt_token_ids are accepted

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("model name must not be empty")
        if not self.fingerprint:
            raise ValueError(f"model {self.name!r}: fingerprint must not be empty")
        if self.max_context < 1:
            raise ValueError(f"model {self.name!r}: max_context must be >= 1")


def load_model_spec(name: str) -> ModelSpec:
    """Tokenizer and config of ``name`` (a built-in name or a Hugging Face directory).

    Uses ``pdserve.models``' config-and-tokenizer loader when it has one (no weights); else its
    full ``load_model``. The fingerprint always comes from there, never recomputed here: a
    router hashing with another recipe would never see a prefix hit.
    """
    try:
        models = importlib.import_module("pdserve.models")
    except ImportError as exc:
        raise ValueError(f"--model: cannot load {name!r}: pdserve.models: {exc}") from exc
    load_info = getattr(models, "load_model_info", None)
    load_model = getattr(models, "load_model", None)
    try:
        if load_info is not None:
            loaded = load_info(name)
        elif load_model is not None:
            loaded = load_model(name)
        else:
            raise ValueError("pdserve.models offers no load_model_info/load_model yet")
    except (OSError, KeyError) as exc:
        raise ValueError(f"--model: cannot load {name!r}: {exc}") from exc
    config = loaded.config
    return ModelSpec(name=name, fingerprint=config.fingerprint,
                     max_context=int(config.max_position_embeddings),
                     tokenizer=loaded.tokenizer)
