"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), answered by the router's
``Tokenize``/``Detokenize``: the token ids ``/v1/completions`` or ``/v1/chat/completions`` would
send for the same prompt or chat, and the text of token ids."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.proto.v1 import router_pb2
from services.gateway.schema import UINT32_MAX, ChatMessage, FieldError, Tool


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True  # plain prompts: BOS as the tokenizer adds it
    add_generation_prompt: bool = True  # chats: end with the assistant's header
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt or messages")
        return self

    def to_proto(self, model: str) -> router_pb2.TokenizeRequest:
        out = router_pb2.TokenizeRequest(model=model,
                                         tools=[t.to_proto() for t in self.tools or ()])
        if self.messages is not None:
            out.chat.messages.extend(m.to_proto() for m in self.messages)
            out.add_generation_prompt = self.add_generation_prompt
        else:
            out.prompt = self.prompt or ""
            out.add_special_tokens = self.add_special_tokens
        return out


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, min_length=1)
    tokens: list[int] = Field(min_length=0)

    @model_validator(mode="after")
    def _ids(self) -> DetokenizeRequest:
        if any(not 0 <= t <= UINT32_MAX for t in self.tokens):
            raise FieldError("tokens", "token ids must be in 0..2^32-1")
        return self


def tokenize_body(reply: router_pb2.TokenizeResponse) -> dict[str, Any]:
    ids = list(reply.token_ids)
    return {"count": len(ids), "max_model_len": reply.max_context, "tokens": ids}
