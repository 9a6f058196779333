"""OpenAI request bodies as pydantic models, and their translation to router ``SamplingParams``.

Unknown fields are ignored (``extra="ignore"``), as OpenAI's own clients send fields a server
may not know. Known fields whose meaning pdserve cannot honour (``suffix``, ``best_of``) are
rejected with a 400 naming them rather than silently dropped. Extensions beyond OpenAI (vLLM's
names): ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``priority``, ``cache_salt``, ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar`` (llguidance's Lark), ``documents`` (chat); ``model`` may be left out when
one model is served.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.proto.v1 import common_pb2, router_pb2
from services.gateway.objects import (
    FieldError,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)

UINT32_MAX = 2**32 - 1
UINT64_MASK = 2**64 - 1
MAX_LOGPROBS = 20  # the router contract's bound on top alternatives
ROLES = {"system", "user", "assistant", "tool", "developer"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    # vLLM's extension: every content chunk also carries the usage so far (cumulative
    # completion tokens), so a client can count tokens whose text came in a later chunk.
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints (OpenAI's names and bounds)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # Extensions (vLLM's names).
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    # vLLM's: salts this request's prefix blocks further (within the caller's own cache).
    cache_salt: str | None = Field(default=None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int]:
        if value and not all(0 <= t <= UINT32_MAX for t in value):
            raise ValueError("token ids must be in 0..2^32-1")
        return value or []

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or int(key) > UINT32_MAX:
                raise ValueError(f"keys must be token ids (as strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for {key}")
        return value

    @model_validator(mode="after")
    def _one_structure(self) -> _Common:
        given = [name for name in ("guided_json", "guided_regex", "guided_choice",
                                   "guided_grammar") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise FieldError(given[1], f"cannot be combined with {given[0]} (one structure "
                             "per request)")
        return self

    def structured(self) -> common_pb2.StructuredOutput | None:
        """response_format or a guided_* extension, as the contract's StructuredOutput."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return common_pb2.StructuredOutput(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            assert fmt.json_schema is not None
            return common_pb2.StructuredOutput(json_schema=json.dumps(fmt.json_schema.schema_))
        if self.guided_json is not None:
            schema = self.guided_json
            return common_pb2.StructuredOutput(
                json_schema=schema if isinstance(schema, str) else json.dumps(schema))
        if self.guided_regex is not None:
            return common_pb2.StructuredOutput(regex=self.guided_regex)
        if self.guided_choice is not None:
            return common_pb2.StructuredOutput(
                choice=common_pb2.StructuredChoice(choices=self.guided_choice))
        if self.guided_grammar is not None:
            return common_pb2.StructuredOutput(grammar=self.guided_grammar)
        return None

    @property
    def calls_finish(self) -> bool:
        """Whether a choice that called tools finishes with "tool_calls"."""
        return False

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every content chunk: asked with ``include_usage`` (as vLLM does)."""
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)

    def router_requests(self, model: str, inputs: list[dict[str, Any]], max_tokens: int | None,
                        logprobs: int | None, request_id: str, tenant: str, cache_salt: str
                        ) -> list[router_pb2.GenerateRequest]:
        """One router call per choice: ``n`` per input, choice ``k*n + i`` using seed + i."""
        return [
            router_pb2.GenerateRequest(
                model=model, sampling=self.sampling(i, max_tokens, logprobs),
                meta=common_pb2.RequestMeta(request_id=f"{request_id}-{k * self.n + i}",
                                            priority=self.priority, tenant=tenant,
                                            cache_salt=cache_salt),
                **one_input, **self.request_fields())
            for k, one_input in enumerate(inputs) for i in range(self.n)
        ]

    def request_fields(self) -> dict[str, Any]:
        """GenerateRequest fields beside input, sampling and meta (tools, echo)."""
        return {}

    def sampling(self, index: int, max_tokens: int | None, logprobs: int | None
                 ) -> common_pb2.SamplingParams:
        """Sampling params of choice ``index`` (its seed is ``seed + index``)."""
        params = common_pb2.SamplingParams(
            max_tokens=max_tokens or 0, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos)
        if self.temperature is not None:
            params.temperature = self.temperature
        if self.top_p is not None:
            params.top_p = self.top_p
        if self.top_k is not None:
            params.top_k = self.top_k
        if self.min_p is not None:
            params.min_p = self.min_p
        if self.seed is not None:
            # OpenAI seeds are signed 64-bit; the contract's are unsigned: wrap, deterministically.
            params.seed = (self.seed + index) & UINT64_MASK
        if logprobs is not None:
            params.logprobs = logprobs
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if getattr(self, name) is not None:
                setattr(params, name, getattr(self, name))
        for token, bias in (self.logit_bias or {}).items():
            params.logit_bias[int(token)] = bias
        structured = self.structured()
        if structured is not None:
            params.structured.CopyFrom(structured)
        return params


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1, le=UINT32_MAX)  # OpenAI's default here
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("must not be an empty list")
            # One member of the union: the list is all ints, all strings or all lists.
            ids: list[int] = value if isinstance(value[0], int) else []
            if isinstance(value[0], list):
                if not all(value):
                    raise ValueError("token id lists must not be empty")
                ids = [t for p in value for t in p]
            if ids and (min(ids) < 0 or max(ids) > UINT32_MAX):
                raise ValueError("token ids must be in 0..2^32-1")
        return value

    @model_validator(mode="after")
    def _completion_only(self) -> CompletionRequest:
        if self.suffix:
            raise FieldError("suffix", "not supported by pdserve")
        if self.best_of not in (None, self.n):
            raise FieldError("best_of", "not supported by pdserve (leave it out or equal to n)")
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def request_fields(self) -> dict[str, Any]:
        return {"echo": True} if self.echo else {}

    def sampling(self, index: int, max_tokens: int | None, logprobs: int | None
                 ) -> common_pb2.SamplingParams:
        params = super().sampling(index, max_tokens, logprobs)
        if self.echo and logprobs is not None:  # the prompt's tokens are scored too
            params.prompt_logprobs = logprobs
        return params

    def inputs(self) -> list[dict[str, Any]]:
        """One router ``input`` oneof per prompt (a list of prompts is a batch)."""
        p: Any = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if isinstance(p[0], int):  # a list of token ids (the lists are of one kind)
            return [{"prompt_token_ids": common_pb2.TokenIds(ids=p)}]
        return [{"prompt": x} if isinstance(x, str) else
                {"prompt_token_ids": common_pb2.TokenIds(ids=x)} for x in p]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value not in ROLES:
            raise ValueError(f"must be one of {sorted(ROLES)}, got {value!r}")
        return value

    @field_validator("content")
    @classmethod
    def _parts(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        if isinstance(value, list):
            for i, part in enumerate(value):
                if part.type != "text":
                    raise ValueError(f"part {i}: unsupported content part type {part.type!r} "
                                     "(only 'text')")
        return value

    def to_proto(self) -> router_pb2.ChatMessage:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # "developer" is OpenAI's newer name for the system role.
        role = "system" if self.role == "developer" else self.role
        return router_pb2.ChatMessage(
            role=role, content=content or "",
            tool_calls=[c.to_proto() for c in self.tool_calls or ()],
            tool_call_id=self.tool_call_id or "", name=self.name or "")


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, str]] | None = None  # vLLM's: for retrieval templates

    @model_validator(mode="after")
    def _chat_only(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "requires logprobs: true")
        names = [t.function.name for t in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise FieldError("tool_choice", f"function {self.tool_choice.function.name!r} "
                                 "is not one of the tools")
        elif self.tool_choice == "required" and not names:
            raise FieldError("tool_choice", "'required' needs tools")
        return self

    @property
    def completion_limit(self) -> int | None:
        """max_completion_tokens wins (max_tokens is its deprecated name)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def calls_finish(self) -> bool:
        """A choice that called tools finishes with "tool_calls" (not for a named function,
        as OpenAI)."""
        return bool(self.tools) and not isinstance(self.tool_choice, NamedToolChoice)

    def request_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.tools:
            fields["tools"] = [t.to_proto() for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            fields["tool_choice"] = router_pb2.ToolChoice(function=self.tool_choice.function.name)
        elif self.tool_choice is not None:
            fields["tool_choice"] = router_pb2.ToolChoice(mode=self.tool_choice)
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        return fields

    def inputs(self) -> list[dict[str, Any]]:
        documents = [router_pb2.Document(fields=d) for d in self.documents or ()]
        return [{"chat": router_pb2.ChatMessages(messages=[m.to_proto() for m in self.messages],
                                                 documents=documents)}]
