"""Decode: take a prefilled request's KV blocks and stream the rest of its answer.

A request's life on a decode instance:

    1. check the block refs against the prompt (hash chain, model, salt)
    2. wait on the local kvd for the blocks (pushed by the prefill node's kvd, or pulled from
       ``source``), bounded by the rpc deadline; copy them into free engine pages registered
       in the prefix cache, then drop the kvd pins
    3. add prompt + [first token] with max_tokens - 1: the engine's prefix cache hits every
       imported block, so only the trailing partial block and the first token are computed
    4. join the running batch; stream every token (text delta, logprobs) until a stop
       condition; the last chunk carries finish_reason and usage
    On cancellation, deadline or Abort the engine request is aborted and its pages freed.
    Role colocated: no first token given -> the engine prefills the prompt itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdserve.engine.async_engine import RequestStream
from pdserve.engine.request import Logprob, RequestOutput
from pdserve.errors import BadRequest, StatusError
from pdserve.proto.v1 import common_pb2
from pdserve.roles import Role
from pdserve.sampling_params import SamplingParams
from services.engine import metrics
from services.engine.instance import EngineInstance

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    first_token_id: int | None = None
    blocks: list[common_pb2.BlockRef] = field(default_factory=list)
    source: common_pb2.KvdEndpoint | None = None
    priority: int = 0
    cache_salt: str = ""
    prior_output: int = 0  # prompt tokens that are output already sent (a failover's)


@dataclass
class Chunk:
    token_ids: list[int]
    logprobs: list[tuple[int, Logprob]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_logprobs: list[Logprob] | None = None  # colocated, first chunk: the prompt's
    # Usage, on the last chunk only.
    completion_tokens: int = 0
    cached_tokens: int = 0


def _blocks_needed(inst: EngineInstance, job: DecodeJob) -> int:
    """Blocks the request takes to start: its prompt's, plus one for the tokens it adds."""
    return len(job.blocks) + 1 if job.blocks else 0


async def run_decode(inst: EngineInstance, job: DecodeJob, timeout: float) -> AsyncIterator[Chunk]:
    """The request's chunks; a prefilled one first waits for room in the KV cache
    (``KvAdmission``), its blocks promised until its first chunk shows it running."""
    admission, need = kv_admission(inst), 0
    if job.first_token_id is not None:
        need = _blocks_needed(inst, job)
        await admission.admit(inst, need, timeout)
    try:
        async for chunk in _run_decode(inst, job, timeout):
            if need:
                admission.settle(need)
                need = 0
            yield chunk
    finally:
        if need:
            admission.settle(need)


async def _run_decode(inst: EngineInstance, job: DecodeJob, timeout: float,
                      ) -> AsyncIterator[Chunk]:
    if job.first_token_id is None:
        if inst.role != Role.COLOCATED:
            # The instance's state, not the request, is at fault: a colocated one (or this
            # one, a flex engine, after switching back) serves it, so the router retries.
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"first_token_id is required on a {inst.role} instance; only a "
                              "colocated engine prefills prompts itself")
        prompt, params = job.prompt, job.params
    else:
        await _receive_blocks(inst, job, timeout)
        if job.params.max_tokens == 1:  # the first token was the whole answer
            yield Chunk([], finish_reason="length", completion_tokens=1)
            return
        prompt = [*job.prompt, job.first_token_id]
        # The prefill scored the prompt already (prompt_logprobs).
        params = dataclasses.replace(job.params, max_tokens=job.params.max_tokens - 1,
                                     prompt_logprobs=None)
    # With a kvd, the finished request's pages stay until its full blocks (prompt and
    # answer) are in the kvd, where the next turn's prefill finds them. Not for a prompt a
    # colocated engine prefilled itself (a flex engine has a kvd): its next turn is served
    # colocated too, from the engine's own prefix cache, as on a `--role colocated` engine;
    # copying every prompt block out would cost CPU that engine serves with.
    is_own_prompt = job.first_token_id is None
    kept = KeptBlocks(inst, job) if inst.bridge is not None and not is_own_prompt else None
    stream = await inst.aengine.add_request(
        job.request_id, prompt, params, job.priority, job.cache_salt,
        hold=kept is not None,
        prior_output=0 if job.first_token_id is None else 1 + job.prior_output)
    try:
        async for chunk in _follow(job, stream, params, kept):
            yield chunk
    finally:
        if not stream.finished:  # cancelled, deadline, or the client went away
            await asyncio.shield(inst.aengine.abort(job.request_id))
        elif kept is not None:  # finished, but the stream may have ended before its release
            await kept.release()


class KvAdmission:
    """Watermark admission of prefilled requests to one engine's KV cache: a request waits
    until the free blocks, less those promised to requests admitted but not yet running, cover
    it; then its share is promised until it runs (its first output), when the engine holds its
    pages. So a burst queues here for KV that running requests free as they finish, instead of
    failing after its prefill was done, and concurrent arrivals never over-commit the cache."""

    POLL_S = 0.02

    def __init__(self) -> None:
        self.num_promised = 0
        self.num_waiting = 0

    async def admit(self, inst: EngineInstance, need: int, timeout: float) -> None:
        """Wait for ``need`` blocks (promised on return), or raise RESOURCE_EXHAUSTED."""
        deadline = time.monotonic() + timeout
        self.num_waiting += 1
        try:
            while True:
                stats = await inst.aengine.call(lambda e: e.stats())
                total = stats.num_blocks_free + stats.num_blocks_used
                if need > total:
                    raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"KV cache: this request needs {need} blocks to start, "
                                      f"more than the {total} the cache has")
                if stats.num_blocks_free - self.num_promised >= need:
                    self.num_promised += need
                    return
                if time.monotonic() + self.POLL_S > deadline:
                    raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"KV cache: {stats.num_blocks_free} free blocks "
                                      f"({self.num_promised} promised), this request needs "
                                      f"{need}; none freed within {timeout:.1f}s",
                                      retry_after=1.0)
                await asyncio.sleep(self.POLL_S)
        finally:
            self.num_waiting -= 1

    def settle(self, need: int) -> None:
        """The admitted request runs (or ended): its blocks are the engine's to count now."""
        self.num_promised = max(0, self.num_promised - need)


_ADMISSIONS: weakref.WeakKeyDictionary[EngineInstance, KvAdmission] = (
    weakref.WeakKeyDictionary())


def kv_admission(inst: EngineInstance) -> KvAdmission:
    """The instance's admission (one per engine instance, gone with it)."""
    admission = _ADMISSIONS.get(inst)
    if admission is None:
        admission = _ADMISSIONS[inst] = KvAdmission()
    return admission


async def _receive_blocks(inst: EngineInstance, job: DecodeJob, timeout: float) -> None:
    if not job.blocks:
        return
    if inst.bridge is None:
        raise BadRequest("blocks: this instance has no kvd (--kvd) to receive them from")
    start = time.monotonic()
    await inst.bridge.receive(job.blocks, job.source, timeout)
    metrics.observe(metrics.KV_WAIT_SECONDS, time.monotonic() - start)
    metrics.count(metrics.BLOCKS, "imported", amount=len(job.blocks))


async def _follow(job: DecodeJob, stream: RequestStream, params: SamplingParams,
                  kept: KeptBlocks | None) -> AsyncIterator[Chunk]:
    num_done = 0 if job.first_token_id is None else 1
    last = time.monotonic()
    async for out in stream:
        chunk = Chunk(list(out.new_token_ids), text=out.text,
                      prompt_logprobs=out.prompt_logprobs)
        if kept is not None and out.new_full_blocks and not out.finished:
            kept.add(out.new_full_blocks)
        if params.logprobs is not None and out.logprobs:
            chunk.logprobs = list(zip(out.new_token_ids, out.logprobs, strict=True))
        num_done += len(out.new_token_ids)
        now = time.monotonic()
        metrics.observe(metrics.TOKEN_GAP_SECONDS, now - last)
        last = now
        if out.finished and kept is not None and out.block_hashes is not None:
            # The answer's last tokens go out now; the stream ends once its blocks are in the
            # kvd, so a next turn sent on that end finds them.
            kept.held = out
            if chunk.token_ids:
                yield chunk
                chunk = Chunk([])
            await kept.finish()
        if out.finished:
            chunk.finish_reason = out.finish_reason
            chunk.completion_tokens = num_done
            # Disaggregated: imported blocks are not this request's cache hits; the router
            # reports the prefill's cached_tokens.
            if job.first_token_id is None:
                chunk.cached_tokens = out.num_prefix_hit_tokens
            metrics.count(metrics.TOKENS, "generated", amount=num_done)
        if chunk.token_ids or chunk.finish_reason:
            yield chunk


class KeptBlocks:
    """A decode request's full blocks, committed to the node's kvd as they fill (the answer's,
    mostly: the prompt's came from there) and indexed like prefill blocks, so the next turn's
    prefill can load them. A failure costs only a later cache miss."""

    def __init__(self, inst: EngineInstance, job: DecodeJob) -> None:
        self.inst, self.job = inst, job
        self.done = {ref.hash for ref in job.blocks}
        self.pending: list[asyncio.Task[None]] = []
        self.held: RequestOutput | None = None  # the finished request, its pages kept
        self.is_released = False

    def add(self, blocks: list[tuple[bytes, int]]) -> None:
        """Blocks of the running request: exported beside the stream."""
        todo = [(h, p) for h, p in blocks if h not in self.done]
        if todo:
            self.done.update(h for h, _ in todo)
            self.pending.append(asyncio.create_task(self._export(todo)))

    async def finish(self) -> None:
        """The finished (held) request: its remaining blocks, then its pages are freed."""
        out = self.held
        assert out is not None and out.block_hashes is not None and out.page_ids is not None
        try:
            await asyncio.gather(*self.pending)
            await self._export([(h, p) for h, p in zip(out.block_hashes, out.page_ids,
                                                       strict=True) if h not in self.done])
        finally:
            await self.release()

    async def release(self) -> None:
        """Free the finished request's pages (once)."""
        if self.held is not None and not self.is_released:
            self.is_released = True
            await asyncio.shield(self.inst.aengine.release(self.job.request_id))

    async def _export(self, todo: list[tuple[bytes, int]]) -> None:
        assert self.inst.bridge is not None
        if not todo:
            return
        try:
            exported = await self.inst.bridge.export(todo, None)
            metrics.count(metrics.BLOCKS, "exported", amount=len(exported))
        except StatusError as exc:
            log.warning("answer blocks not kept in the kvd",
                        extra={"fields": {"request_id": self.job.request_id,
                                          "error": exc.message}})
