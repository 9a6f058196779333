"""Chat templates rendered with transformers' semantics, without importing transformers.

The router renders every chat prompt; it must produce what ``tokenizer.apply_chat_template``
produces for the same model or the served model sees text it was not trained on. What the
template sees, as in transformers (``utils/chat_template_utils.py``, v4.45 to v5):

    environment  ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks), extensions
                 ``loopcontrols`` and ``{% generation %}`` (rendered as its body)
    filters      ``tojson`` = json.dumps(ensure_ascii=False, indent, separators, sort_keys)
                 (Jinja's own escapes HTML)
    globals      ``raise_exception(msg)``, ``strftime_now(fmt)`` (local time),
                 ``dict``, ``namespace`` (no underscore names)
    variables    messages (keys whose value is None dropped), tools (JSON schemas, or None),
                 documents (or None), add_generation_prompt, the tokenizer's named special
                 tokens (bos_token, eos_token, unk_token, pad_token, ...), extra kwargs

Why a copy of that small environment rather than transformers itself: transformers is not a
dependency of the router's image (it would pull huggingface_hub, regex, safetensors and more
for one function); ``tests/foundation/test_chat_template.py`` renders every template of the test
models and a set of templates in the shapes of current model families (tools, documents,
``strftime_now``, ``raise_exception``, ``namespace``, ``{% generation %}``) with both and
requires identical text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import TemplateError, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' names for a message's reasoning; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    transformers; rendering is the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` without attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"got {name!r}")


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """JSON types only, as transformers hands them to the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Keys whose value is None dropped; reasoning under every name templates read."""
    out = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def render(source: str, messages: Sequence[Mapping[str, Any]], *,
           add_generation_prompt: bool = True,
           tools: Sequence[Mapping[str, Any]] | None = None,
           documents: Sequence[Mapping[str, Any]] | None = None,
           special_tokens: Mapping[str, str] | None = None, **kwargs: Any) -> str:
    """The rendered prompt; a template error (``raise_exception`` included) is ValueError."""
    template = compile_template(source)
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return template.render(
            messages=[_message(m) for m in messages],
            tools=None if tools is None else _plain(list(tools)),
            documents=None if documents is None else _plain(list(documents)),
            add_generation_prompt=add_generation_prompt, **_plain(variables))
    except TemplateError as exc:
        raise ValueError(f"chat template failed on these messages: {exc}") from exc
