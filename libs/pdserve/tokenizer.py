"""Tokenizer: a ``tokenizers.Tokenizer`` plus what a Hugging Face model directory says around it
(BOS/EOS, chat template), and each token's own bytes (for logprobs). Streaming text is
``pdserve.engine.detokenizer``'s.

Chat prompts already contain the BOS text when the template writes ``{{ bos_token }}``, so
callers encode rendered chat prompts with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from pdserve import chat_template

# transformers' named special tokens, handed to chat templates by these names.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


def _token_text(token: Any) -> str | None:
    """tokenizer_config writes special tokens as a string or as an AddedToken dict."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token if isinstance(token, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character each byte value is written as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(moved)) for b in range(256)]


def _decoder_types(spec: Any) -> set[str]:
    if not isinstance(spec, Mapping):
        return set()
    return {str(spec.get("type")), *(t for d in spec.get("decoders") or ()
                                     for t in _decoder_types(d))}


class Tokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = self._tok.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        # Named templates ("tool_use" is taken when a request has tools, as transformers does).
        self.chat_templates = dict(chat_templates or {})
        # What chat templates see under transformers' names (bos_token, eos_token, ...).
        self.special_tokens = {**{k: v for k, v in (("bos_token", bos_token),
                                                     ("eos_token", eos_token)) if v},
                               **{k: v for k, v in (special_tokens or {}).items() if v}}
        # None: trust the tokenizer.json post-processor; a bool overrides it (tokenizer_config).
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        decoders = _decoder_types(json.loads(tokenizer.to_str()).get("decoder"))
        self._byte_level = ({c: b for b, c in enumerate(bytes_to_unicode())}
                            if "ByteLevel" in decoders else None)
        self._byte_fallback = "ByteFallback" in decoders
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        path = Path(directory)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer.json not found in {path}")
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        eos_ids = _read_json(path / "generation_config.json").get("eos_token_id")
        if eos_ids is None and eos is not None and tok.token_to_id(eos) is not None:
            eos_ids = tok.token_to_id(eos)
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        template = cfg.get("chat_template")
        named: dict[str, str] = {}
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        legacy = _read_json(path / "special_tokens_map.json")
        special = {name: _token_text(cfg.get(name, legacy.get(name)))
                   for name in SPECIAL_TOKEN_NAMES}
        return cls(
            tok, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids, chat_template=template,
            add_bos_token=cfg.get("add_bos_token"), add_eos_token=cfg.get("add_eos_token"),
            special_tokens={k: v for k, v in special.items() if v}, chat_templates=named,
        )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens or (self.add_bos_token is None and self.add_eos_token is None):
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if self.add_eos_token and self.eos_token_ids:
            ids.append(self.eos_token_ids[0])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any,
    ) -> str:
        """The prompt text, as transformers' ``apply_chat_template(..., tokenize=False)``
        renders it (``pdserve.chat_template``); template errors are ValueError."""
        source = self.chat_template
        if tools is not None and "tool_use" in self.chat_templates:
            source = self.chat_templates["tool_use"]
        if not source:
            raise ValueError("this model has no chat template (tokenizer_config.json "
                             "'chat_template' or chat_template.jinja); use a plain prompt")
        return chat_template.render(source, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, documents=documents,
                                    special_tokens=self.special_tokens, **kwargs)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own: a UTF-8 fragment for a byte-level token
        that splits a character (logprobs report these, as OpenAI's ``bytes``)."""
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._token_bytes(token_id)
        return cached

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        added = self._tok.get_added_tokens_decoder().get(token_id)
        if added is not None:
            return added.content.encode()
        alphabet = self._byte_level
        if alphabet is not None and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        if self._byte_fallback and len(piece) == 6 and piece.startswith("<0x"):
            return bytes([int(piece[3:5], 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """``token_bytes`` as text (an incomplete UTF-8 fragment shows as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")
