"""The two front doors at parity: every field of the gateway's OpenAI request bodies and its
counterpart in the router's ``GenerateRequest`` (what gRPC clients and ``pdserve.client`` send),
or why it has none; and the router's fields the gateway does not expose. docs/grpc.md shows
these tables; ``tests/gateway/test_parity.py`` keeps them complete and true."""

from __future__ import annotations

# OpenAI field (``messages[].role``: a field of each message) -> router field path.
COUNTERPARTS: dict[str, str] = {
    "model": "model",
    "prompt": "prompt | prompt_token_ids",  # text, or token ids; a list: one call each
    "messages": "chat.messages",
    "messages[].role": "chat.messages[].role",  # "developer" is sent as "system"
    "messages[].content": "chat.messages[].content",
    "messages[].content[].text": "chat.messages[].content",  # text parts are joined
    "max_tokens": "sampling.max_tokens",
    "max_completion_tokens": "sampling.max_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",  # choice i of n gets seed + i
    "stop": "sampling.stop",
    "stop_token_ids": "sampling.stop_token_ids",
    "ignore_eos": "sampling.ignore_eos",
    "logprobs": "sampling.logprobs",  # completions: the count; chat: true = 0 alternatives
    "top_logprobs": "sampling.logprobs",
    "priority": "meta.priority",
    "user": "meta.tenant",  # only without API keys; with keys the key's tenant
    # HMAC-SHA256 with the gateway's key of the tenant (or its cache group) and this field.
    "cache_salt": "meta.cache_salt",
}

# OpenAI field -> why the router has no counterpart.
NO_COUNTERPART: dict[str, str] = {
    "n": "the gateway makes n router calls (choice i with seed + i); a gRPC client makes its "
         "own calls",
    "stream": "Generate always streams; a gRPC client reads all of it (collect()) or part",
    "stream_options": "usage is always in the last message of the stream",
    "stream_options.include_usage": "usage is always in the last message of the stream",
    "messages[].content[].type": "only 'text' parts are accepted (by both front doors)",
    "echo": "not supported by pdserve yet (the gateway answers 400)",
    "suffix": "not supported by pdserve yet (the gateway answers 400)",
    "best_of": "not supported by pdserve yet (the gateway answers 400 unless it equals n)",
    "presence_penalty": "not supported by pdserve yet (the gateway answers 400 unless 0)",
    "frequency_penalty": "not supported by pdserve yet (the gateway answers 400 unless 0)",
    "logit_bias": "not supported by pdserve yet (the gateway answers 400)",
    "tools": "tool calling is not supported by pdserve yet (the gateway answers 400); it gets "
             "a router field when the engine supports it",
    "response_format": "structured output is not supported by pdserve yet: only type 'text' "
                       "(the gateway answers 400 to others); it gets a router field when the "
                       "engine constrains decoding",
}

# Router field -> why the gateway does not take it from the request body.
ROUTER_ONLY: dict[str, str] = {
    "meta.request_id": "the gateway names each call <x-request-id>-<choice>",
}
