"""A scripted router core: the layer below the gateway, in place of ``services.router.core``.
It is served both ways the gateway reaches a router: by the real ``RouterServicer`` on a real
``grpc.aio`` server, and in-process by ``EmbeddedRouter`` (``--router embedded``).

The prompt (or a chat's last message) picks the script:

    "quota"     RESOURCE_EXHAUSTED retrying after 7 s (RetryInfo, retry-after trailer)
    "busy"      UNAVAILABLE (RetryInfo: the default 1 s)
    "badparam"  INVALID_ARGUMENT: a field violation of sampling.max_tokens
    "midfail"   two tokens, then INTERNAL
    "abort"     one token, then finish_reason ABORT
    "hang"      placement and one token, then waits until cancelled (recorded in ``cancelled``)
    "hangfirst" waits until cancelled before sending anything
    "toolcall"  some text, then a get_weather call in two deltas, then STOP
    "held"      "Caf", a token with no text yet (half of a UTF-8 character), "é!", then STOP
    anything    the reply REPLY one token a message, honouring max_tokens, stop and seed

With ``echo`` the first message carries the prompt's text (and two prompt logprobs when asked).
Errors are raised as the real core raises them (``StatusError``), so each way answers them as it
answers the real router's. Unknown models get NOT_FOUND. Every request is recorded in
``requests``, with the trace id current while it ran in ``trace_ids``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry import trace

from pdserve.errors import BadRequest, StatusError
from pdserve.proto.v1 import common_pb2, router_pb2

MODEL = "tiny"
REPLY = ["Hello", ",", " world", "!", " END"]
TOKEN_BASE = 100


def prompt_text(req: router_pb2.GenerateRequest) -> str:
    kind = req.WhichOneof("input")
    if kind == "prompt":
        return req.prompt
    if kind == "chat":
        return req.chat.messages[-1].content if req.chat.messages else ""
    return " ".join(str(t) for t in req.prompt_token_ids.ids)


def prompt_len(req: router_pb2.GenerateRequest) -> int:
    if req.WhichOneof("input") == "prompt_token_ids":
        return len(req.prompt_token_ids.ids)
    if req.WhichOneof("input") == "chat":
        return sum(len(m.content.split()) + 2 for m in req.chat.messages)
    return len(req.prompt.split())


class FakeRouter:
    def __init__(self) -> None:
        self.requests: list[router_pb2.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.trace_ids: list[str] = []

    def list_models(self) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(
            models=[router_pb2.ModelInfo(id=MODEL, max_context=2048, block_size=16)])

    def tokenize(self, request: router_pb2.TokenizeRequest) -> router_pb2.TokenizeResponse:
        raise StatusError(grpc.StatusCode.UNIMPLEMENTED, "Tokenize: not scripted")

    def detokenize(self, request: router_pb2.DetokenizeRequest,
                   ) -> router_pb2.DetokenizeResponse:
        raise StatusError(grpc.StatusCode.UNIMPLEMENTED, "Detokenize: not scripted")

    async def generate(self, req: router_pb2.GenerateRequest,
                       time_remaining: Callable[[], float | None],
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        self.requests.append(req)
        span = trace.get_current_span().get_span_context()
        self.trace_ids.append(trace.format_trace_id(span.trace_id))
        if req.model not in ("", MODEL):
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"model: {req.model!r} is not served")
        text = prompt_text(req)
        if text == "quota":
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant token rate exceeded",
                              retry_after=7)
        if text == "busy":
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "no healthy decode instance")
        if text == "badparam":
            raise BadRequest("sampling.max_tokens: must be <= 4096")
        if text == "hangfirst":
            await self._wait_cancelled(req)
        placement = router_pb2.Placement(prefill_instance="p0", decode_instance="d0",
                                         prompt_tokens=prompt_len(req))
        first = router_pb2.GenerateResponse(placement=placement)
        if req.echo:
            first.prompt_text = text
            if req.sampling.HasField("prompt_logprobs"):
                first.prompt_logprobs.extend(_prompt_logprobs(text))
        yield first
        if text == "toolcall":
            for msg in _tool_call():
                yield msg
            return
        if text == "held":
            yield router_pb2.GenerateResponse(token_ids=[TOKEN_BASE], text="Caf")
            yield router_pb2.GenerateResponse(token_ids=[TOKEN_BASE + 1])
            yield router_pb2.GenerateResponse(token_ids=[TOKEN_BASE + 2], text="é!",
                                              finish_reason=common_pb2.FINISH_REASON_STOP,
                                              usage=self._usage(req, 3))
            return
        if text in ("midfail", "abort", "hang"):
            yield self._token(req, 0, REPLY[0])
            if text == "midfail":
                yield self._token(req, 1, REPLY[1])
                raise StatusError(grpc.StatusCode.INTERNAL, "decode instance died")
            if text == "abort":
                yield router_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_ABORT)
                return
            await self._wait_cancelled(req)
        async for msg in self._reply(req):
            yield msg

    async def _wait_cancelled(self, req: router_pb2.GenerateRequest) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.append(req.meta.request_id)
            raise

    async def _reply(self, req: router_pb2.GenerateRequest) -> Any:
        s = req.sampling
        words = list(REPLY)
        if s.HasField("seed"):
            words[0] = f"s{s.seed}"
        limit = s.max_tokens or len(words)
        out, finish = "", common_pb2.FINISH_REASON_STOP
        for i, word in enumerate(words):
            if i == limit:
                finish = common_pb2.FINISH_REASON_LENGTH
                break
            stop = next((x for x in s.stop if x in out + word), None)
            if stop is not None:
                word = (out + word)[: (out + word).index(stop)][len(out):]
                msg = self._token(req, i, word)
                msg.finish_reason = finish
                msg.usage.CopyFrom(self._usage(req, i + 1))
                yield msg
                return
            out += word
            msg = self._token(req, i, word)
            if i == len(words) - 1:
                msg.finish_reason = finish
                msg.usage.CopyFrom(self._usage(req, i + 1))
            yield msg
            await asyncio.sleep(0)
        if finish == common_pb2.FINISH_REASON_LENGTH:
            yield router_pb2.GenerateResponse(finish_reason=finish, usage=self._usage(req, limit))

    def _usage(self, req: router_pb2.GenerateRequest, completion: int) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=prompt_len(req), completion_tokens=completion,
                                cached_tokens=1)

    def _token(self, req: router_pb2.GenerateRequest, i: int, word: str
               ) -> router_pb2.GenerateResponse:
        msg = router_pb2.GenerateResponse(token_ids=[TOKEN_BASE + i], text=word)
        if req.sampling.HasField("logprobs"):
            sampled = common_pb2.TokenLogprob(token_id=TOKEN_BASE + i, logprob=-0.25,
                                              token=word, token_bytes=word.encode())
            top = [sampled]
            top += [common_pb2.TokenLogprob(token_id=1000 + k, logprob=-2.0 - k,
                                            token=f"alt{k}", token_bytes=f"alt{k}".encode())
                    for k in range(req.sampling.logprobs - 1)]
            msg.logprobs.append(common_pb2.PositionLogprobs(sampled=sampled,
                                                            top=top[: req.sampling.logprobs]))
        return msg


def _prompt_logprobs(text: str) -> list[common_pb2.PositionLogprobs]:
    """Two prompt tokens: the first unscored (logprob 0, no alternatives), then one scored."""
    head, tail = text[:1], text[1:]
    first = common_pb2.PositionLogprobs(sampled=common_pb2.TokenLogprob(
        token_id=7, token=head, token_bytes=head.encode()))
    scored = common_pb2.TokenLogprob(token_id=8, logprob=-1.5, token=tail,
                                     token_bytes=tail.encode())
    alt = common_pb2.TokenLogprob(token_id=9, logprob=-0.5, token="alt", token_bytes=b"alt")
    return [first, common_pb2.PositionLogprobs(sampled=scored, top=[alt])]


def _tool_call() -> list[router_pb2.GenerateResponse]:
    return [
        router_pb2.GenerateResponse(token_ids=[1, 2], text="Let me check."),
        router_pb2.GenerateResponse(token_ids=[3, 4], tool_calls=[router_pb2.ToolCallDelta(
            index=0, id="call_abc", name="get_weather", arguments='{"city": ')]),
        router_pb2.GenerateResponse(
            token_ids=[5], tool_calls=[router_pb2.ToolCallDelta(index=0, arguments='"Oslo"}')],
            finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=5)),
    ]
