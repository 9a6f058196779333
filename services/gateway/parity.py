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
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "repetition_penalty": "sampling.repetition_penalty",
    # token id (a string key) -> bias: one map entry each
    "logit_bias": "sampling.logit_bias[].key | sampling.logit_bias[].value",
    "response_format": "sampling.structured",
    "response_format.type": "sampling.structured.json_object | sampling.structured.json_schema",
    "response_format.json_schema": "sampling.structured.json_schema",
    "response_format.json_schema.schema": "sampling.structured.json_schema",  # as JSON text
    "guided_json": "sampling.structured.json_schema",
    "guided_regex": "sampling.structured.regex",
    "guided_choice": "sampling.structured.choice.choices",
    "guided_grammar": "sampling.structured.grammar",
    "echo": "echo | sampling.prompt_logprobs",  # with logprobs n, the prompt's are asked too
    "tools": "tools",
    "tools[].function": "tools",
    "tools[].function.name": "tools[].name",
    "tools[].function.description": "tools[].description",
    "tools[].function.parameters": "tools[].parameters",  # as JSON text
    "tools[].function.strict": "tools[].strict",
    # "auto" | "none" | "required" -> mode; {"type": "function", ...} -> function
    "tool_choice": "tool_choice.mode | tool_choice.function",
    "tool_choice.function": "tool_choice.function",
    "tool_choice.function.name": "tool_choice.function",
    "parallel_tool_calls": "parallel_tool_calls",
    "messages[].tool_calls": "chat.messages[].tool_calls",
    "messages[].tool_calls[].id": "chat.messages[].tool_calls[].id",
    "messages[].tool_calls[].function": "chat.messages[].tool_calls",
    "messages[].tool_calls[].function.name": "chat.messages[].tool_calls[].name",
    "messages[].tool_calls[].function.arguments": "chat.messages[].tool_calls[].arguments",
    "messages[].tool_call_id": "chat.messages[].tool_call_id",
    "messages[].name": "chat.messages[].name",
    "documents": "chat.documents[].fields[].key | chat.documents[].fields[].value",
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
    "stream_options.continuous_usage_stats": "every message carries its own token_ids",
    "messages[].content[].type": "only 'text' parts are accepted (by both front doors)",
    "suffix": "not supported by pdserve yet (the gateway answers 400)",
    "best_of": "not supported by pdserve yet (the gateway answers 400 unless it equals n)",
    "response_format.json_schema.name": "names the schema for the caller; not sent",
    "response_format.json_schema.description": "describes the schema for the caller; not sent",
    "response_format.json_schema.strict": "the grammar always holds the output to the schema",
    "tools[].type": "always 'function' (the only kind)",
    "tool_choice.type": "always 'function' (the only kind)",
    "messages[].tool_calls[].type": "always 'function' (the only kind)",
}

# Router field -> why the gateway does not take it from the request body.
ROUTER_ONLY: dict[str, str] = {
    "meta.request_id": "the gateway names each call <x-request-id>-<choice>",
}
