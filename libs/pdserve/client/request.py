"""Building a ``GenerateRequest`` from the client's arguments: the prompt (text, token ids or
chat messages) and every field of the contract's ``SamplingParams`` and ``RequestMeta`` as a
keyword argument of the same name.

Values are checked by the router (one reading for every front door: its INVALID_ARGUMENT names
the field); here only what cannot be put in the message at all fails, as a ``TypeError`` or
``ValueError`` naming the argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from pdserve.proto.v1 import common_pb2, router_pb2


class GenerateParams(TypedDict, total=False):
    """Keyword arguments of ``generate()`` and ``chat()``: the contract's fields, same names."""

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
    # common.RequestMeta
    request_id: str
    priority: int
    tenant: str
    cache_salt: str


SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
META_FIELDS = frozenset(common_pb2.RequestMeta.DESCRIPTOR.fields_by_name)
Message = Mapping[str, Any] | router_pb2.ChatMessage


def build_request(model: str, prompt: str | Sequence[int] | None = None,
                  messages: Sequence[Message] | None = None,
                  params: Mapping[str, Any] | None = None) -> router_pb2.GenerateRequest:
    """``prompt`` (text or token ids) or ``messages`` (chat turns), sampling and meta fields."""
    request = router_pb2.GenerateRequest(model=model)
    if messages is not None:
        request.chat.SetInParent()
        for i, message in enumerate(messages):
            request.chat.messages.append(_chat_message(i, message))
    elif isinstance(prompt, str):
        request.prompt = prompt
    elif prompt is not None:
        _assign(request.prompt_token_ids, "ids", list(prompt), "prompt")
    for name, value in (params or {}).items():
        if name in SAMPLING_FIELDS:
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


def _assign(message: Any, name: str, value: Any, path: str) -> None:
    try:
        if isinstance(value, (list, tuple)):
            message.ClearField(name)
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
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
    # "developer" is OpenAI's newer name for the system role (the gateway maps it too).
    return router_pb2.ChatMessage(role="system" if role == "developer" else role,
                                  content=content)
