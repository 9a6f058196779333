"""Structured output: what a request's text must follow, compiled to an llguidance grammar.

    StructuredOutput(kind, value)   one of: json_schema (JSON text), json_object, regex,
                                    choice (a tuple of strings), grammar (llguidance's Lark)
    .grammar()                      the llguidance grammar (validated once, cached); a bad one
                                    is BadRequest naming ``structured.<kind>``

The grammar is compiled here, where the router and the engines both read ``SamplingParams``:
the router refuses a bad schema before placing the request, and every engine builds the same
matcher from the same grammar (``pdserve.engine.guided``). llguidance (the Rust library behind
Guidance, also a vLLM and SGLang backend) does the schema compilation, the regex and Lark
parsing and, on the engine, the per-step token masks. JSON is written compactly (no optional
whitespace), so a schema's bounds also bound the output's length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pdserve.errors import BadRequest

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Compact JSON; {"type": "object"} is "any JSON object".
_JSON_OPTIONS: Any = {"whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output; ``value`` is the schema, regex, choices or
    grammar text (unused for json_object)."""

    kind: str
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BadRequest(f"structured: kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind == "choice":
            choices = self.value
            if isinstance(choices, str) or not choices:
                raise BadRequest("structured.choice: must be a non-empty list of strings")
            if any(not isinstance(c, str) or not c for c in choices):
                raise BadRequest("structured.choice: every choice must be a non-empty string")
            object.__setattr__(self, "value", tuple(choices))
        elif self.kind != "json_object" and (not isinstance(self.value, str) or not self.value):
            raise BadRequest(f"structured.{self.kind}: must not be empty")

    def grammar(self) -> str:
        """The llguidance grammar of this constraint; BadRequest when it is invalid."""
        return _compile(self.kind, self.value)


def json_schema(schema: Any) -> StructuredOutput:
    """A json_schema constraint from a parsed schema (a dict)."""
    return StructuredOutput("json_schema", json.dumps(schema, sort_keys=True))


@lru_cache(maxsize=512)
def _compile(kind: str, value: str | tuple[str, ...]) -> str:
    import llguidance

    field = f"structured.{kind}"
    matcher = llguidance.LLMatcher
    if kind in ("json_schema", "json_object"):
        text = _ANY_OBJECT if kind == "json_object" else str(value)
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadRequest(f"{field}: not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise BadRequest(f"{field}: a JSON Schema must be an object or a boolean")
        if isinstance(schema, bool):  # true: anything; false: nothing
            schema = {} if schema else {"not": {}}
        try:
            grammar = matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise BadRequest(f"{field}: {exc}") from None
    elif kind == "regex":
        grammar = matcher.grammar_from_regex(str(value))
    elif kind == "choice":
        # Lark string literals take JSON's escapes, so every choice is matched literally.
        alternatives = " | ".join(json.dumps(c) for c in value)
        grammar = matcher.grammar_from_lark(f"start: {alternatives}")
    else:
        grammar = matcher.grammar_from_lark(str(value))
    is_error, messages = matcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise BadRequest(f"{field}: {_first_line(messages[0])}")
    return str(grammar)


def _first_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "invalid"
