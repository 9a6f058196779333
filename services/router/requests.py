"""Validating a ``GenerateRequest`` and turning it into token ids: every error names its field."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

import grpc

from pdserve.proto.v1 import common_pb2, router_pb2
from pdserve.sampling_params import SamplingParams
from services.router.model import ModelSpec

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_LOGPROBS = 20


class RouteError(Exception):
    """A request that ends with a gRPC status; ``retry_after`` seconds go in trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Prepared:
    """A valid request in the router's terms, ready to hash and place."""

    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams  # max_tokens resolved (never 0)
    meta: common_pb2.RequestMeta  # request_id filled in


def _invalid(message: str) -> RouteError:
    return RouteError(grpc.StatusCode.INVALID_ARGUMENT, message)


def prepare(request: router_pb2.GenerateRequest, model: ModelSpec, limits: Limits) -> Prepared:
    if request.model and request.model != model.name:
        raise RouteError(grpc.StatusCode.NOT_FOUND,
                         f"model: {request.model!r} is not served here (served: {model.name!r})")
    prompt_ids = _tokenize(request, model)
    if not prompt_ids:
        raise _invalid("prompt: must not be empty (it has no tokens)")
    num_prompt = len(prompt_ids)
    if num_prompt > limits.max_prompt_tokens:
        raise _invalid(f"prompt: {num_prompt} tokens, above the limit of "
                       f"{limits.max_prompt_tokens}")
    room = model.max_context - num_prompt
    if room < 1:
        raise _invalid(f"prompt: {num_prompt} tokens leave no room in the model's context of "
                       f"{model.max_context}")
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(request.sampling)
    _check_sampling(sampling)
    if sampling.max_tokens == 0:
        sampling.max_tokens = min(limits.max_tokens, room)
    elif sampling.max_tokens > limits.max_tokens:
        raise _invalid(f"sampling.max_tokens: {sampling.max_tokens} is above the limit of "
                       f"{limits.max_tokens}")
    elif sampling.max_tokens > room:
        raise _invalid(f"sampling.max_tokens: prompt ({num_prompt} tokens) + max_tokens "
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
        raise _invalid("input: one of prompt, prompt_token_ids or chat is required")
    if kind == "prompt_token_ids":
        return list(request.prompt_token_ids.ids)
    if model.tokenizer is None:
        raise _invalid(f"{kind}: this router has no tokenizer for {model.name!r}; "
                       f"send prompt_token_ids")
    if kind == "prompt":
        if not request.prompt:
            raise _invalid("prompt: must not be empty")
        return model.tokenizer.encode(request.prompt)
    messages = request.chat.messages
    if not messages:
        raise _invalid("chat.messages: must not be empty")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise _invalid(f"chat.messages[{i}].role: {m.role!r} is not one of "
                           f"{', '.join(CHAT_ROLES)}")
    try:
        text = model.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages])
    except ValueError as exc:
        raise _invalid(f"chat.messages: {exc}") from exc
    # The rendered template already holds the BOS text where the model wants it.
    return model.tokenizer.encode(text, add_special_tokens=False)


def _check_sampling(s: common_pb2.SamplingParams) -> None:
    if s.HasField("logprobs") and s.logprobs > MAX_LOGPROBS:
        raise _invalid(f"sampling.logprobs: must be in 0..{MAX_LOGPROBS}, got {s.logprobs}")
    for name in ("temperature", "top_p", "min_p"):
        if s.HasField(name) and not math.isfinite(getattr(s, name)):
            raise _invalid(f"sampling.{name}: must be a finite number")
    try:  # the engine's own rules, so a request the router admits is one the engine accepts
        SamplingParams(
            max_tokens=max(1, s.max_tokens),
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k if s.HasField("top_k") else -1,
            min_p=s.min_p if s.HasField("min_p") else 0.0,
            stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
            logprobs=s.logprobs if s.HasField("logprobs") else None)
    except ValueError as exc:
        raise _invalid(f"sampling.{exc}") from exc
