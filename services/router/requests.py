"""Validating a ``GenerateRequest`` and turning it into token ids: every error names its field."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.convert import sampling_from_proto
from pdserve.errors import BadRequest, StatusError
from pdserve.proto.v1 import common_pb2, router_pb2
from pdserve.tool_calls import detect_parser
from services.router import tools as tool_calls
from services.router.model import ModelSpec

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class RouterLimits:
    max_prompt_tokens: int
    max_tokens: int
    max_prompt_bytes: int = 0  # 0: 32 bytes a token (checked before tokenizing)

    def __post_init__(self) -> None:
        if not self.max_prompt_bytes:  # generous: real text averages ~4 bytes a token
            object.__setattr__(self, "max_prompt_bytes", 32 * self.max_prompt_tokens)

    @classmethod
    def for_model(cls, model: ModelSpec, max_prompt_tokens: int, max_tokens: int,
                  max_prompt_bytes: int = 0) -> RouterLimits:
        """Limits of a router serving ``model``; a prompt limit of 0 follows its context
        (a prompt must leave room for one generated token)."""
        prompt = max_prompt_tokens or max(1, model.max_context - 1)
        return cls(prompt, max_tokens, max_prompt_bytes)


@dataclass(frozen=True)
class Prepared:
    """A valid request in the router's terms, ready to hash and place."""

    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams  # max_tokens resolved (never 0)
    meta: common_pb2.RequestMeta  # request_id filled in
    tools: tool_calls.ToolPlan | None = None  # how the answer's tool calls are read
    prompt_text: str = ""  # with echo: the prompt as text


def check_model(name: str, model: ModelSpec) -> None:
    """Empty means the router's model; any of its served names is it."""
    if name and name not in model.names:
        served = ", ".join(repr(n) for n in model.names)
        raise StatusError(grpc.StatusCode.NOT_FOUND,
                          f"model: {name!r} is not served here (served: {served})")


def prepare(request: router_pb2.GenerateRequest, model: ModelSpec,
            limits: RouterLimits, tool_call_parser: str = "auto") -> Prepared:
    check_model(request.model, model)
    tool_plan = None
    if request.tools or request.HasField("tool_choice"):
        chat_template = model.tokenizer.chat_template if model.tokenizer is not None else None
        kind = detect_parser(chat_template) if tool_call_parser == "auto" else tool_call_parser
        tool_plan = tool_calls.plan(request, kind)
    prompt_ids, text = _tokenize(request, model, tool_plan)
    if not prompt_ids:
        raise BadRequest("prompt: must not be empty (it has no tokens)")
    num_prompt = len(prompt_ids)
    if num_prompt > limits.max_prompt_tokens:
        raise BadRequest(f"prompt: {num_prompt} tokens, above the limit of "
                         f"{limits.max_prompt_tokens}")
    room = model.max_context - num_prompt
    if room < 1:
        raise BadRequest(f"prompt: {num_prompt} tokens leave no room in the model's context of "
                         f"{model.max_context}")
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(request.sampling)
    if tool_plan is not None:
        tool_plan.force(sampling)
    sampling_from_proto(sampling, 1)  # the engines' own reading: what the router admits,
    # every engine accepts (max_tokens 0 is resolved below)
    if sampling.max_tokens == 0:
        sampling.max_tokens = min(limits.max_tokens, room)
    elif sampling.max_tokens > limits.max_tokens:
        raise BadRequest(f"sampling.max_tokens: {sampling.max_tokens} is above the limit of "
                         f"{limits.max_tokens}")
    elif sampling.max_tokens > room:
        raise BadRequest(f"sampling.max_tokens: prompt ({num_prompt} tokens) + max_tokens "
                         f"({sampling.max_tokens}) exceed the model's context of "
                         f"{model.max_context}")
    meta = common_pb2.RequestMeta()
    meta.CopyFrom(request.meta)
    if not meta.request_id:
        meta.request_id = uuid.uuid4().hex
    prompt_text = ""
    if request.echo:
        prompt_text = text if text is not None else _decode(model, prompt_ids)
    return Prepared(prompt_ids, sampling, meta, tool_plan, prompt_text)


def _decode(model: ModelSpec, ids: Sequence[int], field: str = "echo") -> str:
    """The text of ``ids``, special tokens included (as echoed and as /detokenize says)."""
    if model.tokenizer is None:
        raise BadRequest(f"{field}: this router has no tokenizer to turn token ids into text")
    return model.tokenizer.decode(ids, skip_special_tokens=False)


def _tokenize(request: router_pb2.GenerateRequest, model: ModelSpec,
              tool_plan: tool_calls.ToolPlan | None = None) -> tuple[list[int], str | None]:
    """The prompt's token ids, and its text when it was given or rendered as text."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise BadRequest("input: one of prompt, prompt_token_ids or chat is required")
    if kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        vocab = model.tokenizer.vocab_size if model.tokenizer is not None else None
        bad = [t for t in ids if vocab is not None and t >= vocab]
        if bad:
            raise BadRequest(f"prompt_token_ids: token ids must be < the vocabulary size "
                             f"{vocab}, got {bad[:5]}")
        return ids, None
    if model.tokenizer is None:
        raise BadRequest(f"{kind}: this router has no tokenizer for {model.name!r}; "
                         f"send prompt_token_ids")
    if kind == "prompt":
        if not request.prompt:
            raise BadRequest("prompt: must not be empty")
        return model.tokenizer.encode(request.prompt), request.prompt
    text = render_chat(request.chat, model, tool_plan.as_template() if tool_plan else None)
    # The rendered template already holds the BOS text where the model wants it.
    return model.tokenizer.encode(text, add_special_tokens=False), text


def render_chat(chat: router_pb2.ChatMessages, model: ModelSpec,
                tools: list[dict[str, Any]] | None, add_generation_prompt: bool = True,
                field: str = "chat") -> str:
    """The chat's prompt text through the model's template (as transformers renders it)."""
    assert model.tokenizer is not None
    messages = chat.messages
    if not messages:
        raise BadRequest(f"{field}.messages: must not be empty")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise BadRequest(f"{field}.messages[{i}].role: {m.role!r} is not one of "
                             f"{', '.join(CHAT_ROLES)}")
    documents = [dict(d.fields) for d in chat.documents] or None
    try:
        return model.tokenizer.apply_chat_template(
            [_message(m) for m in messages], add_generation_prompt=add_generation_prompt,
            tools=tools, documents=documents)
    except ValueError as exc:
        raise BadRequest(f"{field}.messages: {exc}") from exc


def _message(m: router_pb2.ChatMessage) -> dict[str, Any]:
    """A turn as transformers' templates read OpenAI messages: a tool call's arguments as a
    mapping (templates print them with ``tojson``), content None beside tool calls."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in m.tool_calls]
        out["content"] = m.content or None
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text  # shown as given


def tokenize(request: router_pb2.TokenizeRequest, model: ModelSpec) -> list[int]:
    """``Router.Tokenize``: what Generate would make of the same prompt or chat."""
    check_model(request.model, model)
    if model.tokenizer is None:
        raise BadRequest(f"input: this router has no tokenizer for {model.name!r}")
    kind = request.WhichOneof("input")
    if kind is None:
        raise BadRequest("input: one of prompt or chat is required")
    if kind == "prompt":
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return model.tokenizer.encode(request.prompt, add_special_tokens=special)
    tools = None
    if request.tools:
        from pdserve.tool_calls import parse_tools

        tools = [t.as_template() for t in parse_tools(
            [(t.name, t.description, t.parameters, t.strict) for t in request.tools])]
    generation = (request.add_generation_prompt if request.HasField("add_generation_prompt")
                  else True)
    text = render_chat(request.chat, model, tools, generation)
    return model.tokenizer.encode(text, add_special_tokens=False)


def detokenize(request: router_pb2.DetokenizeRequest, model: ModelSpec) -> str:
    check_model(request.model, model)
    bad = [t for t in request.token_ids if model.tokenizer is not None
           and t >= model.tokenizer.vocab_size]
    if bad:
        assert model.tokenizer is not None
        raise BadRequest(f"token_ids: must be < the tokenizer's vocabulary size "
                         f"{model.tokenizer.vocab_size}, got {bad[:5]}")
    return _decode(model, request.token_ids, "token_ids")
