"""gRPC edge of the prefill service: proto <-> dataclass conversion, then delegation."""

from __future__ import annotations

import time
import uuid

import grpc
from opentelemetry import trace

from pdserve.convert import finish_to_proto, logprobs_to_proto, prompt_logprobs_to_proto
from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from pdserve.roles import Role
from pdserve.rpc import rpc_handler
from services.engine import metrics
from services.engine.convert import prompt_and_params
from services.engine.instance import EngineInstance, kvd_timeout
from services.prefill.prefill import PrefillJob, PrefillResult, run_prefill


class PrefillServicer(engine_pb2_grpc.PrefillServicer):
    def __init__(self, instance: EngineInstance) -> None:
        self.instance = instance

    @rpc_handler("Prefill", metrics.count_rpc)
    async def Prefill(self, request: engine_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.PrefillResponse:
        inst = self.instance
        rid = request.meta.request_id or f"prefill-{uuid.uuid4().hex}"
        start = time.monotonic()
        trace.get_current_span().set_attributes(
            {"request_id": rid, "prompt_tokens": len(request.prompt_token_ids)})
        job = _job_from_proto(request, rid, inst)
        with inst.admit(Role.PREFILL, restartable=rid):
            timeout = kvd_timeout(context, inst.config.kvd_timeout)
            result = await run_prefill(inst, job, timeout)
        metrics.observe(metrics.PREFILL_SECONDS, time.monotonic() - start)
        return _result_to_proto(result, inst, job)


def _job_from_proto(request: engine_pb2.PrefillRequest, rid: str,
                    inst: EngineInstance) -> PrefillJob:
    prompt, params = prompt_and_params(request.prompt_token_ids, request.sampling, inst.limits)
    dest = request.destination if request.HasField("destination") else None
    if dest is not None and not dest.address:
        dest = None
    return PrefillJob(rid, prompt, params, request.meta.priority, request.meta.cache_salt, dest)


def _result_to_proto(result: PrefillResult, inst: EngineInstance,
                     job: PrefillJob) -> engine_pb2.PrefillResponse:
    node = inst.bridge.node_id if inst.bridge is not None else ""
    out = engine_pb2.PrefillResponse(
        first_token_id=result.first_token_id,
        blocks=[common_pb2.BlockRef(hash=b.hash, checksum=b.checksum, node_id=node)
                for b in result.blocks],
        tail_token_ids=result.tail_token_ids, cached_tokens=result.cached_tokens,
        timings=engine_pb2.PrefillTimings(queue_ms=result.queue_ms,
                                          compute_ms=result.compute_ms,
                                          commit_ms=result.commit_ms),
        finish_reason=finish_to_proto(result.finish_reason), text=result.text,
        model_version=inst.engine.model_version)
    if result.first_logprob is not None and job.params.logprobs is not None:
        out.first_logprobs.CopyFrom(logprobs_to_proto(result.first_token_id,
                                                      result.first_logprob,
                                                      inst.engine.tokenizer))
    if result.prompt_logprobs is not None:
        out.prompt_logprobs.extend(prompt_logprobs_to_proto(job.prompt, result.prompt_logprobs,
                                                            inst.engine.tokenizer))
    if inst.bridge is not None:
        out.source.CopyFrom(inst.bridge.endpoint)
    return out
