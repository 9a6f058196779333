"""OpenAI response shapes: whole responses, SSE chunks, and logprobs.

Token strings in logprobs are the engines': each sampled token and each alternative carries its
own text and bytes (a token that splits a character has a fragment of it: its text shows
U+FFFD, its bytes are exact). A model without a tokenizer sends none: then the string is
``token_id:<id>`` (vLLM's spelling of an undecoded token). ``text_offset`` is exact for
one-token messages and the message's start offset otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdserve.proto.v1 import common_pb2, router_pb2
from services.gateway.errors import ApiError
from services.gateway.generate import ChoiceOutput, usage_of

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _token(entry: common_pb2.TokenLogprob) -> tuple[str, list[int]]:
    """The token's string and bytes."""
    if not entry.token and not entry.token_bytes:
        name = f"token_id:{entry.token_id}"
        return name, list(name.encode())
    return entry.token, list(entry.token_bytes)


def chat_logprobs(msg: router_pb2.GenerateResponse) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` entries of one router message."""
    out = []
    for pos in msg.logprobs:
        top = []
        for alt in pos.top:
            alt_token, alt_bytes = _token(alt)
            top.append({"token": alt_token, "logprob": alt.logprob, "bytes": alt_bytes})
        token, raw = _token(pos.sampled)
        out.append({"token": token, "logprob": pos.sampled.logprob, "bytes": raw,
                    "top_logprobs": top})
    return out


def completion_logprobs(entries: Sequence[tuple[router_pb2.GenerateResponse, int]],
                        prompt: Sequence[common_pb2.PositionLogprobs] = (),
                        shift: int = 0) -> dict[str, list[Any]]:
    """Legacy completions logprobs: parallel lists over the tokens. With echo, ``prompt``
    (one entry per prompt token; the first, which nothing scores, gets null logprobs) comes
    first, and generated offsets are ``shift`` (the prompt text's length) further."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = 0
    for i, pos in enumerate(prompt):
        token = _token(pos.sampled)[0]
        tokens.append(token)
        offsets.append(at)
        at += len(token)
        if i == 0:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(pos.sampled.logprob)
        top = {token: pos.sampled.logprob}
        top.update({_token(a)[0]: a.logprob for a in pos.top})
        top_logprobs.append(top)
    for msg, offset in entries:
        for pos in msg.logprobs:
            token = _token(pos.sampled)[0]
            tokens.append(token)
            token_logprobs.append(pos.sampled.logprob)
            top = {token: pos.sampled.logprob}
            top.update({_token(a)[0]: a.logprob for a in pos.top})
            top_logprobs.append(top)
            offsets.append(offset + shift)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def completion_body(rid: str, created: int, model: str, choices: Sequence[ChoiceOutput], n: int,
                    logprobs: bool) -> dict[str, Any]:
    """With echo, each choice's text and logprobs begin with the prompt's."""
    def lp(c: ChoiceOutput) -> dict[str, Any] | None:
        if not logprobs:
            return None
        return completion_logprobs(c.logprobs, c.prompt_logprobs, len(c.prompt_text))

    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": i, "text": c.prompt_text + c.text, "finish_reason": c.finish,
                     "logprobs": lp(c)} for i, c in enumerate(choices)],
        "usage": usage_of(choices, n),
    }


def tool_call_deltas(msg: router_pb2.GenerateResponse) -> list[dict[str, Any]]:
    """OpenAI's ``delta.tool_calls``: a call's first piece has its id, type and name."""
    out = []
    for d in msg.tool_calls:
        function: dict[str, Any] = {"arguments": d.arguments}
        delta: dict[str, Any] = {"index": d.index}
        if d.id:
            delta.update(id=d.id, type="function")
            function = {"name": d.name, "arguments": d.arguments}
        delta["function"] = function
        out.append(delta)
    return out


def _message(c: ChoiceOutput) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant",
                               "content": c.text if c.text or not c.tool_calls else None,
                               "refusal": None}
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    return message


def chat_body(rid: str, created: int, model: str, choices: Sequence[ChoiceOutput], n: int,
              logprobs: bool) -> dict[str, Any]:
    def lp(c: ChoiceOutput) -> dict[str, Any] | None:
        if not logprobs:
            return None
        return {"content": [e for msg, _ in c.logprobs for e in chat_logprobs(msg)],
                "refusal": None}

    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "finish_reason": c.finish, "logprobs": lp(c),
                     "message": _message(c)} for i, c in enumerate(choices)],
        "usage": usage_of(choices, n),
        "system_fingerprint": None,
    }


class ChunkWriter:
    """SSE chunks of one stream; the constant head of every chunk is encoded once."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool,
                 logprobs: bool) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": model}
        self._head = b"data: " + _dumps(head)[:-1].encode() + b',"choices":'
        self._tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        self.chat = chat
        self.logprobs = logprobs
        self._offsets: dict[int, int] = {}

    def role(self, index: int) -> bytes:
        """Chat's first chunk of a choice: the assistant role, no content yet."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._head + _dumps([choice]).encode() + self._tail

    def chunk(self, index: int, msg: router_pb2.GenerateResponse, finish: str | None,
              usage: dict[str, object] | None = None) -> bytes | None:
        """The chunk of one router message, or None when it carries nothing to show.
        ``usage``: the request's usage so far, for ``continuous_usage_stats`` (else null)."""
        if not (msg.text or msg.prompt_text or msg.tool_calls or finish is not None
                or (self.logprobs and (msg.logprobs or msg.prompt_logprobs))):
            return None
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": msg.text} if msg.text else {}
            if msg.tool_calls:
                choice["delta"]["tool_calls"] = tool_call_deltas(msg)
            lp: dict[str, Any] | None = (
                {"content": chat_logprobs(msg), "refusal": None} if self.logprobs else None)
        else:
            choice["text"] = msg.prompt_text + msg.text  # echo: the prompt comes first
            offset = self._offsets.get(index, 0) + len(msg.prompt_text)
            lp = (completion_logprobs([(msg, offset)], msg.prompt_logprobs) if self.logprobs
                  else None)
            self._offsets[index] = offset + len(msg.text)
        choice["logprobs"] = lp
        choice["finish_reason"] = finish
        tail = self._tail if usage is None else (
            b',"usage":' + _dumps(usage).encode() + b"}\n\n")
        return self._head + _dumps([choice]).encode() + tail

    def usage(self, choices: Sequence[ChoiceOutput], n: int) -> bytes:
        """The final ``include_usage`` chunk: usage, and no choices."""
        return self._head + b'[],"usage":' + _dumps(usage_of(choices, n)).encode() + b"}\n\n"


def sse_error(error: ApiError) -> bytes:
    return b"data: " + _dumps(error.body()).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    return _dumps(obj).encode()
