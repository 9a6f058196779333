"""Prefill: run one prompt to its first token and leave its KV blocks in the node's kvd.

A request's life on a prefill instance:

    1. hash the prompt's full blocks; ask the local kvd for the leading run it holds and import
       those into the engine (a prefix hit instead of a recompute)
    2. add the request to the engine as prefill_only: chunked prefill, then the first token
    3. after every chunk, copy that chunk's new full blocks into kvd slots and commit them with
       the decode node's kvd as destination, so kvd pushes them while later chunks compute
    4. on the first token: commit whatever full block kvd does not hold yet (engine-local
       prefix hits), release the engine's pages (kvd holds the blocks now), answer with the
       first token, its text (what a stop string cannot still cut), whether it ends the
       request, the block refs (hash + xxh3 of the bytes), the tail tokens and timings
    On any failure or cancellation the engine request is aborted, which frees its pages.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from pdserve.engine.request import Logprob, RequestOutput
from pdserve.errors import StatusError
from pdserve.hashing import hash_blocks
from pdserve.kvd.bridge import Exported
from pdserve.proto.v1 import common_pb2
from pdserve.sampling_params import SamplingParams
from services.engine import metrics
from services.engine.instance import EngineInstance


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str = ""
    destination: common_pb2.KvdEndpoint | None = None


@dataclass
class PrefillResult:
    first_token_id: int
    first_logprob: Logprob | None
    blocks: list[Exported]
    tail_token_ids: list[int]
    cached_tokens: int
    finish_reason: str | None
    text: str
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    commit_ms: float = 0.0
    prompt_logprobs: list[Logprob] | None = None


@dataclass
class _Commits:
    """The blocks this request has put in kvd, and the time it took."""

    done: dict[bytes, Exported] = field(default_factory=dict)
    seconds: float = 0.0


async def run_prefill(inst: EngineInstance, job: PrefillJob, kvd_timeout: float) -> PrefillResult:
    bs = inst.block_size
    hashes = hash_blocks(job.prompt, bs, inst.engine.fingerprint, job.cache_salt)
    commits = _Commits()
    if inst.bridge is not None and job.params.prompt_logprobs is None:
        # (Scoring the prompt computes all of it: nothing to load.)
        # The engine never takes the block holding the last prompt token from cache: its
        # logits must be computed.
        usable = hashes[: (len(job.prompt) - 1) // bs]
        for exported in await inst.bridge.load_prefix(usable, kvd_timeout):
            commits.done[exported.hash] = exported
        metrics.count(metrics.BLOCKS, "imported", amount=len(commits.done))
    stream = await inst.aengine.add_request(job.request_id, job.prompt, job.params,
                                            job.priority, job.cache_salt, prefill_only=True)
    try:
        final = await _consume(inst, stream, job, commits)
        result = await _finish(inst, job, final, hashes, commits)
    except BaseException:
        await asyncio.shield(inst.aengine.abort(job.request_id))
        raise
    result.queue_ms = stream.times.queue_s * 1e3
    result.compute_ms = stream.times.compute_s * 1e3
    result.commit_ms = commits.seconds * 1e3
    metrics.count(metrics.TOKENS, "cached", amount=result.cached_tokens)
    metrics.count(metrics.TOKENS, "prompt", amount=len(job.prompt) - result.cached_tokens)
    return result


async def _consume(inst: EngineInstance, stream: object, job: PrefillJob,
                   commits: _Commits) -> RequestOutput:
    """Follow the engine's chunks, committing each chunk's full blocks as it lands."""
    final: RequestOutput | None = None
    async for out in stream:  # type: ignore[attr-defined]
        if out.finished and out.finish_reason == "abort":
            raise StatusError(grpc.StatusCode.ABORTED, f"request {job.request_id!r} was aborted")
        if out.new_full_blocks:
            await _commit(inst, out.new_full_blocks, job.destination, commits)
        if out.finished:
            final = out
    assert final is not None
    return final


async def _commit(inst: EngineInstance, blocks: list[tuple[bytes, int]],
                  destination: common_pb2.KvdEndpoint | None, commits: _Commits) -> None:
    todo = [(h, p) for h, p in blocks if h not in commits.done]
    if inst.bridge is None or not todo:
        return
    start = time.monotonic()
    for exported in await inst.bridge.export(todo, destination):
        commits.done[exported.hash] = exported
    commits.seconds += time.monotonic() - start
    metrics.count(metrics.BLOCKS, "exported", amount=len(todo))


async def _finish(inst: EngineInstance, job: PrefillJob, final: RequestOutput, hashes: list[bytes],
                  commits: _Commits) -> PrefillResult:
    block_hashes, page_ids = final.block_hashes or [], final.page_ids or []
    # Blocks the engine took from its own prefix cache were never reported as new: kvd may
    # have evicted them since, so commit them too (a duplicate commit is cheap for kvd).
    await _commit(inst, list(zip(block_hashes, page_ids, strict=True)), job.destination, commits)
    await inst.aengine.release(job.request_id)
    num_full = len(hashes)
    # The engine's own stop rules decided whether the first token ends the request; its
    # text leaves out what a decode engine, replaying that token, releases later.
    return PrefillResult(
        first_token_id=final.new_token_ids[0],
        first_logprob=final.logprobs[0] if final.logprobs else None,
        blocks=[commits.done.get(h, Exported(h, 0)) for h in hashes],
        tail_token_ids=job.prompt[num_full * inst.block_size:],
        cached_tokens=final.num_prefix_hit_tokens,
        finish_reason=final.finish_reason, text=final.text,
        prompt_logprobs=final.prompt_logprobs)
