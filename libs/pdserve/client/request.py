"""Building a ``GenerateRequest`` from the client's arguments: the prompt (text, token ids or
chat messages) and every field of the contract's ``SamplingParams`` and ``RequestMeta`` as a
keyword argument of the same name.

Values are checked by the router (one reading for every front door: its INVALID_ARGUMENT names
the field); here only what cannot be put in the message at all fails, as a ``TypeError`` or
``ValueError`` naming the argument.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from google.protobuf import json_format

from pdserve.proto.v1 import common_pb2, router_pb2

ToolArg = Mapping[str, Any] | router_pb2.Tool


class GenerateParams(TypedDict, total=False):
    """Keyword arguments of ``generate()`` and ``chat()``: the contract's fields, same names.

    ``structured``: a ``StructuredOutput`` or its JSON mapping (``{"json_schema": "..."}``,
    ``{"regex": ...}``, ``{"choice": {"choices": [...]}}``); ``tools``: ``Tool``s or mappings
    ``{"name", "description", "parameters" (a schema mapping or JSON text), "strict"}``;
    ``tool_choice``: "auto" | "none" | "required" | ``{"function": name}``."""

    # common.SamplingParams
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float]
    structured: Mapping[str, Any] | common_pb2.StructuredOutput
    prompt_logprobs: int
    # router.GenerateRequest, beside the input
    tools: Sequence[ToolArg]
    tool_choice: str | Mapping[str, str] | router_pb2.ToolChoice
    parallel_tool_calls: bool
    echo: bool
    # common.RequestMeta
    request_id: str
    priority: int
    tenant: str
    cache_salt: str


SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
META_FIELDS = frozenset(common_pb2.RequestMeta.DESCRIPTOR.fields_by_name)
REQUEST_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "echo"})
Message = Mapping[str, Any] | router_pb2.ChatMessage


def build_request(model: str, prompt: str | Sequence[int] | None = None,
                  messages: Sequence[Message] | None = None,
                  params: Mapping[str, Any] | None = None,
                  documents: Sequence[Mapping[str, str]] | None = None,
                  ) -> router_pb2.GenerateRequest:
    """``prompt`` (text or token ids) or ``messages`` (chat turns, with ``documents`` for
    retrieval templates), sampling, meta and request fields."""
    request = router_pb2.GenerateRequest(model=model)
    if messages is not None:
        request.chat.SetInParent()
        for i, message in enumerate(messages):
            request.chat.messages.append(_chat_message(i, message))
        for doc in documents or ():
            request.chat.documents.add(fields=dict(doc))
    elif isinstance(prompt, str):
        request.prompt = prompt
    elif prompt is not None:
        _assign(request.prompt_token_ids, "ids", list(prompt), "prompt")
    for name, value in (params or {}).items():
        if name in REQUEST_FIELDS:
            _request_field(request, name, value)
        elif name in SAMPLING_FIELDS:
            if name == "stop" and isinstance(value, str):
                value = [value]
            _assign(request.sampling, name, value, f"sampling.{name}")
        elif name in META_FIELDS:
            _assign(request.meta, name, value, f"meta.{name}")
        else:
            raise TypeError(f"unexpected keyword argument {name!r} (sampling fields: "
                            f"{', '.join(sorted(SAMPLING_FIELDS))}; meta fields: "
                            f"{', '.join(sorted(META_FIELDS))})")
    return request


def build_tokenize_request(model: str, prompt: str | None = None,
                           messages: Sequence[Message] | None = None,
                           add_special_tokens: bool = True, add_generation_prompt: bool = True,
                           tools: Sequence[ToolArg] = ()) -> router_pb2.TokenizeRequest:
    """``Router.Tokenize`` of a text prompt or chat ``messages`` (rendered with ``tools``)."""
    request = router_pb2.TokenizeRequest(model=model,
                                         tools=[_tool(i, t) for i, t in enumerate(tools)])
    if messages is not None:
        request.chat.messages.extend(_chat_message(i, m) for i, m in enumerate(messages))
        request.add_generation_prompt = add_generation_prompt
    else:
        request.prompt = prompt or ""
        request.add_special_tokens = add_special_tokens
    return request


def _request_field(request: router_pb2.GenerateRequest, name: str, value: Any) -> None:
    if name == "tools":
        request.tools.extend(_tool(i, t) for i, t in enumerate(value))
    elif name == "tool_choice":
        if isinstance(value, str):
            request.tool_choice.mode = value
        else:
            _assign(request, name, value, name)
    else:
        _assign(request, name, value, name)


def _tool(i: int, tool: ToolArg) -> router_pb2.Tool:
    if isinstance(tool, router_pb2.Tool):
        return tool
    params = tool.get("parameters")
    try:
        return router_pb2.Tool(
            name=tool["name"], description=tool.get("description") or "",
            parameters=params if isinstance(params, str) or params is None else json.dumps(params),
            strict=bool(tool.get("strict")))
    except (KeyError, TypeError) as exc:
        raise TypeError(f"tools[{i}]: must be a Tool or a mapping with 'name' "
                        f"(description, parameters, strict), got {tool!r}") from exc


def _assign(message: Any, name: str, value: Any, path: str) -> None:
    try:
        field = message.DESCRIPTOR.fields_by_name[name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            message.ClearField(name)
            getattr(message, name).update(value)
        elif field.message_type is not None and not field.is_repeated:
            target = getattr(message, name)
            if isinstance(value, Mapping):
                json_format.ParseDict(dict(value), target)
            else:
                target.CopyFrom(value)
        elif isinstance(value, (list, tuple)):
            message.ClearField(name)
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    except json_format.ParseError as exc:
        raise ValueError(f"{path}: {exc} (got {value!r})") from None
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{path}: {exc} (got {value!r})") from None


def _chat_message(i: int, message: Message) -> router_pb2.ChatMessage:
    """A chat turn from ``{"role", "content"}`` (content: text, or OpenAI text parts)."""
    if isinstance(message, router_pb2.ChatMessage):
        return message
    if not isinstance(message, Mapping) or "role" not in message:
        raise TypeError(f"messages[{i}]: must be a mapping with 'role' and 'content', "
                        f"got {message!r}")
    content = message.get("content") or ""
    if not isinstance(content, str):
        try:
            if any(part["type"] != "text" for part in content):
                raise KeyError("type")
            content = "".join(str(part["text"]) for part in content)
        except (KeyError, TypeError):
            raise TypeError(f"messages[{i}].content: must be text or a list of "
                            f"{{'type': 'text', 'text': ...}} parts") from None
    role = str(message["role"])
    calls = []
    for call in message.get("tool_calls") or ():  # OpenAI's shape
        function = call.get("function", call)
        arguments = function.get("arguments") or ""
        calls.append(router_pb2.ToolCall(
            id=call.get("id") or "", name=function["name"],
            arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
    # "developer" is OpenAI's newer name for the system role (the gateway maps it too).
    return router_pb2.ChatMessage(role="system" if role == "developer" else role,
                                  content=content, tool_calls=calls,
                                  tool_call_id=message.get("tool_call_id") or "",
                                  name=message.get("name") or "")
