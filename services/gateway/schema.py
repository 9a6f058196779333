"""OpenAI request bodies as pydantic models, and their translation to router ``SamplingParams``.

Unknown fields are ignored (``extra="ignore"``), as OpenAI's own clients send fields a server
may not know. Known fields whose meaning pdserve cannot honour (``echo``, penalties,
``logit_bias``, tools) are rejected with a 400 naming them rather than silently dropped.
Extensions beyond OpenAI: ``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ``priority``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.proto.v1 import common_pb2, router_pb2

UINT32_MAX = 2**32 - 1
UINT64_MASK = 2**64 - 1
MAX_LOGPROBS = 20  # the router contract's bound on top alternatives
ROLES = {"system", "user", "assistant", "tool", "developer"}


class FieldError(ValueError):
    """A model-level check that names its field (pydantic would otherwise report loc=())."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints (OpenAI's names and bounds)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names).
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

    @model_validator(mode="after")
    def _unsupported(self) -> _Common:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise FieldError(name, "not supported by pdserve (use 0 or leave it out)")
        if self.logit_bias:
            raise FieldError("logit_bias", "not supported by pdserve")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

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
                **one_input)
            for k, one_input in enumerate(inputs) for i in range(self.n)
        ]

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
            ids = [t for p in value if isinstance(p, list) for t in p]
            if any(isinstance(p, list) and not p for p in value):
                raise ValueError("token id lists must not be empty")
            if any(isinstance(t, int) and not 0 <= t <= UINT32_MAX for t in [*value, *ids]):
                raise ValueError("token ids must be in 0..2^32-1")
        return value

    @model_validator(mode="after")
    def _completion_only(self) -> CompletionRequest:
        if self.echo:
            raise FieldError("echo", "not supported by pdserve")
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

    def inputs(self) -> list[dict[str, Any]]:
        """One router ``input`` oneof per prompt (a list of prompts is a batch)."""
        p: Any = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if all(isinstance(x, int) for x in p):
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
        return router_pb2.ChatMessage(role=role, content=content or "")


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_only(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "requires logprobs: true")
        if self.tools:
            raise FieldError("tools", "tool calling is not supported by pdserve")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise FieldError("response_format", "only type 'text' is supported")
        return self

    @property
    def completion_limit(self) -> int | None:
        """max_completion_tokens wins (max_tokens is its deprecated name)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def inputs(self) -> list[dict[str, Any]]:
        return [{"chat": router_pb2.ChatMessages(messages=[m.to_proto() for m in self.messages])}]
