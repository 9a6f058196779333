"""One OpenAI request as router calls: fan out (``n`` x prompts), read, merge, account.

Life cycle of a request::

    Generation(calls) -> await start()      # first message of every call (placement) or an
                                            # error status, before any HTTP byte is sent
                      -> async for messages()   # (choice index, GenerateResponse), interleaved
                      -> cancel()            # always, in a finally: cancels what still runs

Choice ``i`` of a completion with several prompts answers prompt ``i // n``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.proto.v1 import common_pb2, router_pb2
from services.gateway.errors import ApiError
from services.gateway.router_client import GenerateCall, RouterApi

FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


def finish_reason(msg: router_pb2.GenerateResponse) -> str | None:
    """OpenAI's finish reason of a message; None while running; ApiError if it was aborted."""
    reason = msg.finish_reason
    if reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    if reason in FINISH:
        return FINISH[reason]
    raise ApiError(502, "the router aborted the generation", "server_error", code="aborted")


@dataclass
class ChoiceOutput:
    """What one choice has produced so far. ``calls_finish``: a choice that called tools
    finishes with "tool_calls" instead of "stop"."""

    calls_finish: bool = False
    texts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[tuple[router_pb2.GenerateResponse, int]] = field(default_factory=list)
    finish: str | None = None
    usage: common_pb2.Usage | None = None
    prompt_tokens: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # merged, by index
    prompt_text: str = ""
    prompt_logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)

    def add(self, msg: router_pb2.GenerateResponse, text_offset: int) -> None:
        if msg.text:
            self.texts.append(msg.text)
        self.num_tokens += len(msg.token_ids)
        if msg.logprobs:
            self.logprobs.append((msg, text_offset))
        if msg.HasField("placement"):
            self.prompt_tokens = msg.placement.prompt_tokens
        if msg.HasField("usage"):
            self.usage = msg.usage
        self.prompt_text += msg.prompt_text
        self.prompt_logprobs.extend(msg.prompt_logprobs)
        for delta in msg.tool_calls:
            if delta.index >= len(self.tool_calls):
                self.tool_calls.append({"id": delta.id, "type": "function",
                                        "function": {"name": delta.name, "arguments": ""}})
            self.tool_calls[delta.index]["function"]["arguments"] += delta.arguments
        self.finish = finish_reason(msg) or self.finish
        if self.finish == "stop" and self.tool_calls and self.calls_finish:
            self.finish = "tool_calls"

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else self.num_tokens


def usage_of(choices: Sequence[ChoiceOutput], n: int) -> dict[str, object]:
    """OpenAI usage: each prompt's tokens once (its choices share it), all completions summed."""
    prompt = cached = 0
    for first in choices[::n]:
        prompt += first.usage.prompt_tokens if first.usage is not None else first.prompt_tokens
        cached += first.usage.cached_tokens if first.usage is not None else 0
    completion = sum(c.completion_tokens for c in choices)
    version = next((c.usage.model_version for c in choices if c.usage is not None), "")
    usage: dict[str, object] = {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached},
        "model_version": version}  # pdserve's: the weights version that answered
    failovers = sum(c.usage.failovers for c in choices if c.usage is not None)
    if failovers:  # pdserve's: the answer moved to another decode engine mid-stream
        usage["failovers"] = failovers
    return usage


class Generation:
    """The router calls of one request, read as one interleaved stream."""

    def __init__(self, client: RouterApi, metadata: tuple[tuple[str, str], ...],
                 requests: Sequence[router_pb2.GenerateRequest], start_time: float,
                 timeout: float | None = None) -> None:
        self.start_time = start_time  # the HTTP request's arrival (perf_counter), for TTFT
        self.first_token_time: float | None = None
        self.timeout = timeout if timeout is not None else client.timeout
        self.calls: list[GenerateCall] = [client.generate(r, metadata, timeout)
                                          for r in requests]
        self._firsts: list[router_pb2.GenerateResponse | None] = []

    async def start(self) -> None:
        """Wait for every call's first message: an error status raises before any output."""
        if len(self.calls) == 1:  # the common case, without gather's tasks
            results = [await self.calls[0].read()]
        else:
            results = await asyncio.gather(*(c.read() for c in self.calls))
        self._firsts = [None if m is grpc.aio.EOF else m for m in results]

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.start_time

    async def messages(self) -> AsyncIterator[tuple[int, router_pb2.GenerateResponse]]:
        """Every message after ``start()``, as (choice index, message); raises AioRpcError."""
        for i, first in enumerate(self._firsts):
            if first is not None:
                yield self._seen(i, first)
        if len(self.calls) == 1:  # the common case, without tasks or a queue
            if self._firsts[0] is not None:
                call = self.calls[0]
                while (msg := await call.read()) is not grpc.aio.EOF:
                    yield self._seen(0, msg)
            return
        async for i, msg in self._merged([i for i, m in enumerate(self._firsts) if m]):
            yield self._seen(i, msg)

    def _seen(self, i: int, msg: router_pb2.GenerateResponse
              ) -> tuple[int, router_pb2.GenerateResponse]:
        if self.first_token_time is None and msg.token_ids:
            self.first_token_time = time.perf_counter()
        return i, msg

    async def _merged(self, live: list[int]
                      ) -> AsyncIterator[tuple[int, router_pb2.GenerateResponse]]:
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

        async def pump(i: int, call: GenerateCall) -> None:
            try:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    queue.put_nowait((i, msg))
                queue.put_nowait((i, None))
            except grpc.aio.AioRpcError as exc:
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, self.calls[i])) for i in live]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, grpc.aio.AioRpcError):
                    raise item
                else:
                    assert isinstance(item, router_pb2.GenerateResponse)
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()


async def collect(gen: Generation, num_choices: int, calls_finish: bool = False
                  ) -> list[ChoiceOutput]:
    """Read a whole generation (the non-streaming answer)."""
    choices = [ChoiceOutput(calls_finish) for _ in range(num_choices)]
    offsets = [0] * num_choices
    async for i, msg in gen.messages():
        choices[i].add(msg, offsets[i])
        offsets[i] += len(msg.text)
    for choice in choices:
        if choice.finish is None:
            raise ApiError(502, "the router's stream ended without a finish reason",
                           "server_error", code="incomplete")
    return choices
