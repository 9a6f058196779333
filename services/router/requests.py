"""Validating a ``GenerateRequest`` and turning it into token ids: every error names its field."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import grpc

from pdserve.convert import sampling_from_proto
from pdserve.errors import BadRequest, StatusError
from pdserve.proto.v1 import common_pb2, router_pb2
from services.router.model import ModelSpec

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class RouterLimits:
    max_prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Prepared:
    """A valid request in the router's terms, ready to hash and place."""

    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams  # max_tokens resolved (never 0)
    meta: common_pb2.RequestMeta  # request_id filled in


def prepare(request: router_pb2.GenerateRequest, model: ModelSpec,
            limits: RouterLimits) -> Prepared:
    if request.model and request.model != model.name:
        raise StatusError(grpc.StatusCode.NOT_FOUND,
                          f"model: {request.model!r} is not served here (served: {model.name!r})")
    prompt_ids = _tokenize(request, model)
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
    return Prepared(prompt_ids, sampling, meta)


def _tokenize(request: router_pb2.GenerateRequest, model: ModelSpec) -> list[int]:
    kind = request.WhichOneof("input")
    if kind is None:
        raise BadRequest("input: one of prompt, prompt_token_ids or chat is required")
    if kind == "prompt_token_ids":
        return list(request.prompt_token_ids.ids)
    if model.tokenizer is None:
        raise BadRequest(f"{kind}: this router has no tokenizer for {model.name!r}; "
                         f"send prompt_token_ids")
    if kind == "prompt":
        if not request.prompt:
            raise BadRequest("prompt: must not be empty")
        return model.tokenizer.encode(request.prompt)
    messages = request.chat.messages
    if not messages:
        raise BadRequest("chat.messages: must not be empty")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise BadRequest(f"chat.messages[{i}].role: {m.role!r} is not one of "
                             f"{', '.join(CHAT_ROLES)}")
    try:
        text = model.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages])
    except ValueError as exc:
        raise BadRequest(f"chat.messages: {exc}") from exc
    # The rendered template already holds the BOS text where the model wants it.
    return model.tokenizer.encode(text, add_special_tokens=False)
