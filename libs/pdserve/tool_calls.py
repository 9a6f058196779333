"""Tool calling: tool definitions, the grammars that force a call, and the parsers that find
calls in generated text, streaming.

    ToolSpec(name, description, parameters, strict)   one function; ``as_template()`` is what
                                                       chat templates receive (OpenAI's shape)
    forced_output(tools, choice, parallel)            tool_choice required / a named function:
                                                       a json_schema the output must follow
                                                       (vLLM's shapes), so the call always parses
    make_parser(kind, tools, choice) -> ToolParser    feed(text) / finish() -> Parsed(content,
                                                       calls): calls as OpenAI's stream deltas

Parsers (the JSON tool-call formats of the supported model families):

    hermes       Hermes, Qwen2/2.5/3: ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``
                 anywhere in the text; text outside the tags is content
    llama3_json  Llama 3.x: the whole answer is ``{"name": .., "parameters": {..}}`` (several
                 joined by ``;``); anything else is content
    named        tool_choice = a function: the whole output is its arguments, streamed as they come
    required     tool_choice = required: a JSON array of {"name", "parameters"}; each call is sent
                 once its object is complete

A block that does not parse is given back as content, as vLLM does. Call ids are ``call_`` +
24 random hex digits.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import BadRequest
from pdserve.structured import StructuredOutput, json_schema

PARSERS = ("hermes", "llama3_json")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool = False

    def as_template(self) -> dict[str, Any]:
        """OpenAI's tool object, as chat templates expect it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}


def parse_tools(raw: Sequence[tuple[str, str, str, bool]], field: str = "tools"
                ) -> list[ToolSpec]:
    """(name, description, parameters JSON text, strict) per tool; BadRequest naming it."""
    tools, seen = [], set()
    for i, (name, description, parameters, strict) in enumerate(raw):
        if not _NAME.match(name):
            raise BadRequest(f"{field}[{i}].name: must be 1-64 of a-z, A-Z, 0-9, _ and -, "
                             f"got {name!r}")
        if name in seen:
            raise BadRequest(f"{field}[{i}].name: {name!r} is defined twice")
        seen.add(name)
        schema = None
        if parameters:
            try:
                schema = json.loads(parameters)
            except json.JSONDecodeError as exc:
                raise BadRequest(f"{field}[{i}].parameters: not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise BadRequest(f"{field}[{i}].parameters: must be a JSON Schema object")
        tools.append(ToolSpec(name, description, schema, strict))
    return tools


def forced_output(tools: Sequence[ToolSpec], function: str | None, parallel: bool
                  ) -> StructuredOutput:
    """The constraint of tool_choice required (``function`` None) or a named function."""
    if function is not None:
        tool = next(t for t in tools if t.name == function)
        return json_schema(tool.schema)
    items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t.name}, "parameters": t.schema}} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return json_schema(schema)


@dataclass
class CallDelta:
    """A piece of one call (OpenAI's ``delta.tool_calls[]``): the first piece of a call has
    its id and name; arguments arrive in pieces to concatenate."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser(ABC):
    """Streams text in, content and call deltas out; ``finish`` flushes what is held."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> Parsed: ...

    @abstractmethod
    def finish(self) -> Parsed: ...

    def _call(self, name: str, arguments: Any) -> list[CallDelta]:
        """One whole call (dropped past the first when parallel calls are off)."""
        if not self.parallel and self.num_calls >= 1:
            return []
        args = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                       ensure_ascii=False)
        self.num_calls += 1
        return [CallDelta(self.num_calls - 1, new_call_id(), name, args)]


def _as_call(obj: Any, names: set[str], args_keys: tuple[str, ...]) -> tuple[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names and obj["name"] not in names:
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    return obj["name"], args


class HermesParser(ToolParser):
    def __init__(self, names: set[str], parallel: bool = True) -> None:
        super().__init__(parallel)
        self.names = names
        self.buffer = ""
        self.inside = False

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while True:
            if not self.inside:
                i = self.buffer.find(_HERMES_OPEN)
                if i < 0:  # hold back what could begin the tag
                    keep = _partial_suffix(self.buffer, _HERMES_OPEN)
                    out.content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                out.content += self.buffer[:i]
                self.buffer, self.inside = self.buffer[i + len(_HERMES_OPEN):], True
            j = self.buffer.find(_HERMES_CLOSE)
            if j < 0:
                return out
            out.add(self._block(self.buffer[:j]))
            self.buffer, self.inside = self.buffer[j + len(_HERMES_CLOSE):], False

    def finish(self) -> Parsed:
        out = self._block(self.buffer) if self.inside else Parsed(self.buffer)
        self.buffer, self.inside = "", False
        return out

    def _block(self, body: str) -> Parsed:
        try:
            call = _as_call(json.loads(body), self.names, ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return Parsed(f"{_HERMES_OPEN}{body}{_HERMES_CLOSE}")
        return Parsed(calls=self._call(*call))


class Llama3JsonParser(ToolParser):
    def __init__(self, names: set[str], parallel: bool = True) -> None:
        super().__init__(parallel)
        self.names = names
        self.buffer = ""
        self.mode: str | None = None  # "json" once the answer starts with {, else "text"

    def feed(self, text: str) -> Parsed:
        if self.mode == "text":
            return Parsed(text)
        self.buffer += text
        stripped = self.buffer.lstrip()
        if not stripped:
            return Parsed()
        if self.mode is None:
            self.mode = "json" if stripped.startswith("{") else "text"
        if self.mode == "text":
            out, self.buffer = self.buffer, ""
            return Parsed(out)
        return Parsed()

    def finish(self) -> Parsed:
        text, self.buffer = self.buffer, ""
        if self.mode != "json":
            return Parsed(text)
        calls: list[tuple[str, Any]] = []
        decoder, pos = json.JSONDecoder(), 0
        body = text.strip()
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return Parsed(text)
            call = _as_call(obj, self.names, ("parameters", "arguments"))
            if call is None:
                return Parsed(text)
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        out = Parsed()
        for call in calls:
            out.calls += self._call(*call)
        return out


class NamedParser(ToolParser):
    """tool_choice = one function: the output is its arguments (forced by a grammar)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        if self.num_calls == 0:
            self.num_calls = 1
            return Parsed(calls=[CallDelta(0, new_call_id(), self.name, text)])
        return Parsed(calls=[CallDelta(0, arguments=text)])

    def finish(self) -> Parsed:
        return self.feed("") if self.num_calls else Parsed(
            calls=[CallDelta(0, new_call_id(), self.name, "")])


class RequiredParser(ToolParser):
    """tool_choice = required: ``[{"name": .., "parameters": {..}}, ...]`` (forced by a grammar);
    each call goes out as soon as its object is complete."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.buffer = ""
        self.pos = 0  # next unread character of buffer
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while True:
            while self.pos < len(self.buffer) and self.buffer[self.pos] in " \n\t[,":
                self.pos += 1
            if self.pos >= len(self.buffer) or self.buffer[self.pos] != "{":
                return out
            try:
                obj, end = self.decoder.raw_decode(self.buffer, self.pos)
            except json.JSONDecodeError:
                return out  # not complete yet
            self.pos = end
            call = _as_call(obj, set(), ("parameters", "arguments"))
            if call is not None:
                out.calls += self._call(*call)

    def finish(self) -> Parsed:
        out = self.feed("")
        if self.num_calls == 0:  # cut short (max_tokens) before one call was complete
            out.content = self.buffer
        return out


def detect_parser(chat_template: str | None) -> str:
    """The format a model's chat template shows it was trained on (Hermes when unsure)."""
    template = chat_template or ""
    if _HERMES_OPEN in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def make_parser(kind: str, tools: Sequence[ToolSpec], mode: str, function: str | None,
                parallel: bool) -> ToolParser | None:
    """The parser of a request; None when its text is plain content (tool_choice none)."""
    if function is not None:
        return NamedParser(function)
    if mode == "none":
        return None
    if mode == "required":
        return RequiredParser(parallel)
    names = {t.name for t in tools}
    return HermesParser(names, parallel) if kind == "hermes" else Llama3JsonParser(names,
                                                                                  parallel)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that ``tag`` begins with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
