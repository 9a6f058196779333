"""The two engine phases of one request, with their retries (steps 5-7 of ``core``); the
request's state and the errors raised are ``flow``'s."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from pdserve.errors import StatusError
from pdserve.proto.v1 import common_pb2, engine_pb2, router_pb2
from services.router import metrics
from services.router.flow import (
    KV_LOST,
    RETRYABLE,
    Busy,
    Down,
    Flow,
    Interrupted,
    KvLost,
    retry_after_of,
    rpc_error,
)
from services.router.health import watched
from services.router.instances import Instance, InstancePool
from services.router.policy import RoutingPolicy


async def run_prefill(flow: Flow, policy: RoutingPolicy, pool: InstancePool,
                      prefills: Sequence[Instance], decodes: Sequence[Instance],
                      ) -> router_pb2.GenerateResponse:
    """Place and prefill, moving to another prefill instance on a retryable failure."""
    assert flow.query is not None
    tried: list[str] = []
    failures: list[str] = []
    busy_after: list[float] = []  # one per RESOURCE_EXHAUSTED answer
    for _ in range(flow.max_retries + 1):
        left = [p for p in prefills if p.address not in tried and p.is_healthy]
        choice = policy.choose(flow.query, left, decodes) if left else None
        if choice is None or choice.prefill is None:
            break
        p, d = choice.prefill, choice.decode
        uncached = flow.query.num_prompt_tokens - choice.cached_blocks * flow.query.block_size
        request = _prefill_request(flow)
        if d.kvd_node_id:
            request.destination.node_id, request.destination.address = d.kvd_node_id, d.kvd_address
        p.num_routed += 1
        p.num_inflight_prefills += 1
        p.num_inflight_prefill_tokens += uncached
        flow.touched.append(p)
        try:
            flow.before_call()
            call = p.prefill.Prefill(request, timeout=flow.timeout(), metadata=flow.metadata)
            response = await watched(call, p, flow.stalls, True, call.cancel, "prefill")
        except grpc.RpcError as exc:
            pool.mark_failed(p, exc.code())
            if exc.code() not in RETRYABLE:
                raise rpc_error(exc, f"prefill on {p.instance_id}") from exc
            metrics.RETRIES.labels("prefill").inc()
            tried.append(p.address)
            failures.append(f"{p.instance_id}: {exc.code().name} {exc.details()}")
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                busy_after.append(retry_after_of(exc))
            continue
        finally:
            p.num_inflight_prefills -= 1
            p.num_inflight_prefill_tokens -= uncached
        flow.touched.remove(p)  # done: the prefill engine holds nothing of the request now
        flow.choice, flow.prefill_response = choice, response
        return _first_message(flow, response)
    why = "; ".join(failures) if failures else "no healthy prefill instance"
    if failures and len(busy_after) == len(failures):
        raise Busy(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"no capacity: every prefill instance is busy ({why})", min(busy_after))
    raise Down(grpc.StatusCode.UNAVAILABLE, f"no capacity: prefill failed ({why})")


def _prefill_request(flow: Flow) -> engine_pb2.PrefillRequest:
    """The prompt, or after a failover the prompt and the answer so far but its last token:
    only their KV is wanted, the token sampled after them is dropped (greedy, not stopping)."""
    if flow.resume is None:
        return engine_pb2.PrefillRequest(meta=flow.prepared.meta,
                                         prompt_token_ids=flow.prepared.prompt_ids,
                                         sampling=flow.prepared.sampling)
    return engine_pb2.PrefillRequest(
        meta=flow.prepared.meta, prompt_token_ids=flow.resume.prompt_ids,
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))


def _first_message(flow: Flow, response: engine_pb2.PrefillResponse,
                   ) -> router_pb2.GenerateResponse:
    if flow.resume is None:  # after a failover the client has its tokens already
        flow.num_tokens_sent = 1
        flow.sent_ids = [response.first_token_id]
    message = router_pb2.GenerateResponse(token_ids=[response.first_token_id],
                                          text=response.text, placement=flow.placement())
    if response.HasField("first_logprobs"):
        message.logprobs.append(response.first_logprobs)
    message.prompt_logprobs.extend(response.prompt_logprobs)
    if response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        message.finish_reason = response.finish_reason
        message.usage.CopyFrom(flow.usage(response.cached_tokens))
        message.usage.model_version = response.model_version
    return message


def _decode_request(flow: Flow, decode: Instance) -> engine_pb2.DecodeRequest:
    request = engine_pb2.DecodeRequest(meta=flow.prepared.meta,
                                       prompt_token_ids=flow.prepared.prompt_ids,
                                       sampling=flow.prepared.sampling)
    resume = flow.resume
    if resume is not None:  # no blocks (no prefill): the engine computes them itself
        request.prompt_token_ids[:] = resume.prompt_ids
        request.sampling.CopyFrom(resume.sampling)
        request.first_token_id, request.prior_output = resume.first_token_id, resume.prior_output
    pre = flow.prefill_response
    if pre is not None:
        assert flow.choice is not None
        request.first_token_id = pre.first_token_id
        request.blocks.extend(pre.blocks)
        # Blocks were pushed to the first choice's kvd, but not all of them need be (prefill
        # pushes only what it commits, not a prefix it loaded from its kvd; a push may fail):
        # whatever is missing is pulled from prefill's kvd, which holds every block.
        request.source.CopyFrom(pre.source)
    return request


async def relay_decode(flow: Flow, policy: RoutingPolicy, pool: InstancePool,
                       decodes: Sequence[Instance], first: router_pb2.GenerateResponse | None,
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
    """Stream Decode's chunks; a decode failing before its first chunk is replaced.

    ``first`` (prefill's token) goes out right after the Decode call is started, so writing
    it to the client overlaps the decode RPC's setup instead of preceding it."""
    assert flow.choice is not None and flow.query is not None
    decode, tried = flow.choice.decode, []
    if not _can_take(flow, decode):  # drained or reloaded (rolling reload) since chosen
        decode = _next_decode(flow, policy, decodes, [decode.address]) or decode
    busy_after: list[float] = []
    for attempt in range(flow.max_retries + 1):
        chunks_before = flow.num_decode_chunks
        try:
            async for message in _relay_one(flow, decode, first):
                yield message
            return
        except grpc.RpcError as exc:
            code, where = exc.code(), f"decode on {decode.instance_id}"
            if (code in KV_LOST and flow.prefill_response is not None
                    and flow.num_decode_chunks == chunks_before):
                raise KvLost(grpc.StatusCode.UNAVAILABLE, f"{where} could not get the "
                             f"request's KV blocks: {exc.details()}") from exc
            pool.mark_failed(decode, code)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED or code not in RETRYABLE:
                raise rpc_error(exc, where) from exc
            if flow.num_decode_chunks > chunks_before:  # the client has part of this answer
                raise Interrupted(f"{where} failed after {flow.num_tokens_sent} tokens were "
                                  f"sent: {code.name} {exc.details()}", decode) from exc
            tried.append(decode.address)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                busy_after.append(retry_after_of(exc))
            replacement = _next_decode(flow, policy, decodes, tried)
            if (replacement is None or attempt == flow.max_retries) and len(busy_after) == len(
                    tried):
                raise Busy(code, f"no capacity: every decode instance is busy ({where}: "
                           f"{exc.details()})", min(busy_after)) from exc
            if replacement is None or attempt == flow.max_retries:
                raise Down(grpc.StatusCode.UNAVAILABLE,
                                  f"no capacity: {where} failed ({code.name} {exc.details()}) "
                                  f"and no other decode instance is left to try") from exc
            metrics.RETRIES.labels("decode").inc()
            decode, first = replacement, None


async def prefill_again(flow: Flow, policy: RoutingPolicy, pool: InstancePool, lost: KvLost,
                        prefills: Sequence[Instance], decodes: Sequence[Instance]) -> None:
    """The decode could not get the request's KV (``KvLost``): prefill the prompt again on one
    of ``prefills`` (healthy, alike), another instance than the first when there is one. The
    client already has the first token, so it stays; the new prefill's own first token is
    dropped (the prompt's KV does not depend on it). Without a prefill and a decode left,
    ``lost`` goes to the client."""
    assert flow.prefill_response is not None and flow.choice is not None
    sent, lost_on = flow.prefill_response.first_token_id, flow.choice.prefill
    prefills = [p for p in prefills if p is not lost_on] or list(prefills)
    if not prefills or not decodes:
        raise StatusError(lost.code, f"{lost.message}; no healthy prefill and decode pair is "
                          "left to compute them again")
    metrics.RETRIES.labels("prefill_again").inc()
    await run_prefill(flow, policy, pool, prefills, decodes)
    flow.prefill_response.first_token_id = sent


def _next_decode(flow: Flow, policy: RoutingPolicy, decodes: Sequence[Instance],
                 tried: list[str]) -> Instance | None:
    assert flow.choice is not None and flow.query is not None
    left = [d for d in decodes if d.address not in tried and _can_take(flow, d)]
    prefill = flow.choice.prefill
    choice = policy.choose(flow.query, [prefill] if prefill else [], left) if left else None
    if choice is None:
        return None
    if prefill is None:  # colocated: the new engine is the whole placement
        flow.choice = choice
    return choice.decode


def _can_take(flow: Flow, decode: Instance) -> bool:
    """Healthy, and serving the weights version that computed the request's blocks: a
    rolling reload may have swapped it since the request was placed."""
    pre = flow.prefill_response
    version, serving = pre.model_version if pre is not None else "", decode.stats.model_version
    return decode.is_healthy and (not version or not serving or serving == version)


async def _relay_one(flow: Flow, decode: Instance, first: router_pb2.GenerateResponse | None,
                     ) -> AsyncIterator[router_pb2.GenerateResponse]:
    request, timeout = _decode_request(flow, decode), flow.timeout()
    decode.num_routed += 1
    decode.num_inflight_decodes += 1
    flow.touched.append(decode)
    flow.before_call()
    call = decode.decode.Decode(request, timeout=timeout, metadata=flow.metadata)
    is_first = flow.prefill_response is None and not flow.sent_ids  # colocated, not resumed
    try:
        if first is not None:
            yield first
        async for chunk in _chunks(flow, decode, call):
            message = router_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text,
                                                  logprobs=chunk.logprobs,
                                                  finish_reason=chunk.finish_reason,
                                                  prompt_logprobs=chunk.prompt_logprobs)
            if is_first:  # colocated: placement rides on the first message
                message.placement.CopyFrom(flow.placement())
                is_first = False
            flow.num_tokens_sent += len(chunk.token_ids)
            flow.sent_ids.extend(chunk.token_ids)
            flow.num_decode_chunks += 1
            if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                pre = flow.prefill_response
                cached = pre.cached_tokens if pre is not None else chunk.usage.cached_tokens
                message.usage.CopyFrom(flow.usage(cached))
                message.usage.model_version = chunk.usage.model_version
                yield message
                return
            yield message
        raise _StreamEnded(decode.instance_id)
    finally:
        call.cancel()  # no-op when finished; on client cancel or error, frees the engine's side
        decode.num_inflight_decodes -= 1


async def _chunks(flow: Flow, decode: Instance, call: grpc.aio.UnaryStreamCall,
                  ) -> AsyncIterator[engine_pb2.DecodeChunk]:
    """``call``'s chunks; a decode that stops sending them and answers no health check
    raises ``Stalled`` (``health``)."""
    is_first = True
    while True:
        chunk = await watched(call.read(), decode, flow.stalls, is_first, call.cancel, "decode")
        if chunk is grpc.aio.EOF:
            return
        is_first = False
        yield chunk


class _StreamEnded(grpc.RpcError):
    """A Decode stream that closed without a finish_reason: a broken engine, retried."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(f"{instance_id}: stream ended without finish_reason")
        self._details = "stream ended without finish_reason"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNKNOWN

    def details(self) -> str:
        return self._details
