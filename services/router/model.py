"""What the router needs to know about the model: its tokenizer, fingerprint and context length.

A router never needs the weights: it tokenizes, renders chat templates and hashes blocks with
the model's fingerprint (the same one engines and kvd use, or no prefix would ever match).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class TextTokenizer(Protocol):
    """The part of ``pdserve.tokenizer.Tokenizer`` the router uses."""

    chat_template: str | None

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            documents: Sequence[Mapping[str, Any]] | None = None) -> str: ...


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what it was loaded from (a built-in name or a directory): ModelInfo.root
    fingerprint: str
    max_context: int
    tokenizer: TextTokenizer | None = None  # None: only prompt_token_ids are accepted
    served_names: tuple[str, ...] = ()  # the ids clients use; none = ``name``

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_names or (self.name,)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("model name must not be empty")
        if not self.fingerprint:
            raise ValueError(f"model {self.name!r}: fingerprint must not be empty")
        if self.max_context < 1:
            raise ValueError(f"model {self.name!r}: max_context must be >= 1")


def load_model_spec(name: str, served_names: Sequence[str] = ()) -> ModelSpec:
    """Tokenizer, fingerprint and context of ``name`` (a built-in or a Hugging Face directory),
    without loading weights. The fingerprint recipe is ``pdserve.models``' own: a router
    hashing with another would never see a prefix hit."""
    from pdserve.models import builtin, files
    from pdserve.tokenizer import Tokenizer

    parsed = builtin.parse_builtin(name)
    if parsed is not None:
        base, seed = parsed
        cfg = builtin.hf_config(base)
        return ModelSpec(name=name, fingerprint=builtin.fingerprint(base, seed),
                         max_context=int(cfg["max_position_embeddings"]),
                         tokenizer=files.builtin_tokenizer(), served_names=tuple(served_names))
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model: {name!r} is neither a built-in "
                         f"({', '.join(builtin.BUILTIN_MODELS)}) nor a directory with "
                         f"config.json")
    try:
        config_text = (path / "config.json").read_text(encoding="utf-8")
        fingerprint = files.fingerprint(config_text, files.weight_files(path))
        tokenizer = Tokenizer.from_dir(path)
    except (OSError, KeyError) as exc:
        raise ValueError(f"--model: cannot load {name!r}: {exc}") from exc
    cfg = json.loads(config_text)
    return ModelSpec(name=name, fingerprint=fingerprint,
                     max_context=int(cfg.get("max_position_embeddings") or 2048),
                     tokenizer=tokenizer, served_names=tuple(served_names))
