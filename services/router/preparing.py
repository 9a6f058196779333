"""Limits before work, and tokenizing off the event loop.

A request's size is checked in bytes before anything is tokenized (``check_size``: one pass
over the text, no tokenizer), so a multi-megabyte prompt is refused in microseconds instead of
after seconds of tokenizing. Prompts that pass and are long are tokenized and hashed in a
small worker pool with a bounded backlog (``Preparer``): the event loop keeps serving every
other request meanwhile, and a flood of long prompts is refused (RESOURCE_EXHAUSTED) instead
of queueing without end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from pdserve.errors import BadRequest, StatusError
from pdserve.hashing import hash_blocks
from pdserve.proto.v1 import router_pb2
from services.router.model import ModelSpec
from services.router.requests import Prepared, RouterLimits, prepare

T = TypeVar("T")
# Above this many prompt characters or token ids, preparing runs in the worker pool.
HEAVY_PROMPT = 4096
HEAVY_TOKENS = HEAVY_PROMPT // 4  # ... or prompt tokens, for hashing (~4 characters a token)


def prompt_size(request: router_pb2.GenerateRequest) -> tuple[str, int]:
    """The input's field and its size: UTF-8 bytes of text, or the number of token ids."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return "prompt", _utf8_len(request.prompt)
    if kind == "chat":
        return "chat.messages", sum(_utf8_len(m.content) + _utf8_len(m.name)
                                    for m in request.chat.messages)
    if kind == "prompt_token_ids":
        return "prompt_token_ids", len(request.prompt_token_ids.ids)
    return "input", 0


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_size(request: router_pb2.GenerateRequest, limits: RouterLimits) -> None:
    """Refuse an input too large to be worth tokenizing (see the module doc)."""
    field_name, size = prompt_size(request)
    # Token ids need no tokenizing: ``prepare`` counts them against max_prompt_tokens.
    if field_name != "prompt_token_ids" and size > limits.max_prompt_bytes:
        raise BadRequest(f"{field_name}: {size} bytes, above the limit of "
                         f"{limits.max_prompt_bytes} bytes (--max-prompt-bytes; the prompt may "
                         f"have at most {limits.max_prompt_tokens} tokens)")


@dataclass
class Preparer:
    """The router's tokenizing: inline for short prompts, else in ``num_workers`` threads
    with at most ``max_pending`` prompts waiting or running there."""

    num_workers: int = 2
    max_pending: int = 16
    num_pending: int = 0
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="tokenize")

    async def run(self, request: router_pb2.GenerateRequest, model: ModelSpec,
                  limits: RouterLimits, tool_call_parser: str) -> Prepared:
        check_size(request, limits)
        _, size = prompt_size(request)
        todo = (request, model, limits, tool_call_parser)
        if size <= HEAVY_PROMPT:
            return prepare(*todo)
        return await self._offload(lambda: prepare(*todo))

    async def hash(self, prepared: Prepared, block_size: int, fingerprint: str) -> list[bytes]:
        args = (prepared.prompt_ids, block_size, fingerprint, prepared.meta.cache_salt)
        if len(prepared.prompt_ids) <= HEAVY_TOKENS:
            return hash_blocks(*args)
        return await self._offload(lambda: hash_blocks(*args))

    async def _offload(self, work: Callable[[], T]) -> T:
        if self.num_pending >= self.max_pending:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"router: {self.num_pending} long prompts are being tokenized "
                              f"(at most {self.max_pending}); try again shortly",
                              retry_after=1.0)
        self.num_pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work)
        finally:
            self.num_pending -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
