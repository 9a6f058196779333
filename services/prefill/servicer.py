"""gRPC edge of the prefill service: proto <-> dataclass conversion, then delegation."""

from __future__ import annotations

import time
import uuid
from typing import Any

import grpc

from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from pdserve.serving import metrics
from pdserve.serving.admin import EngineAdminServicer
from pdserve.serving.convert import (
    check_prompt,
    finish_to_proto,
    logprobs_to_proto,
    sampling_from_proto,
)
from pdserve.serving.errors import rpc_status
from pdserve.serving.instance import Instance
from pdserve.telemetry import server_span
from services.prefill.prefill import PrefillJob, PrefillResult, run_prefill


class PrefillServicer(engine_pb2_grpc.PrefillServicer):
    def __init__(self, instance: Instance) -> None:
        self.instance = instance

    async def Prefill(self, request: engine_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.PrefillResponse:
        inst = self.instance
        rid = request.meta.request_id or f"prefill-{uuid.uuid4().hex}"
        start = time.monotonic()
        with server_span("Prefill.Prefill", context, request_id=rid,
                         prompt_tokens=len(request.prompt_token_ids)):
            async with rpc_status(context, "Prefill"):
                job = _job_from_proto(request, rid, inst)
                with inst.admit("prefill"):
                    timeout = _timeout(context, inst.config.kvd_timeout)
                    result = await run_prefill(inst, job, timeout)
        metrics.PREFILL_SECONDS.observe(time.monotonic() - start)
        return _result_to_proto(result, inst, job)


def _timeout(context: grpc.aio.ServicerContext, default: float) -> float:
    remaining = context.time_remaining()
    return default if remaining is None else max(0.001, min(default, remaining))


def _job_from_proto(request: engine_pb2.PrefillRequest, rid: str, inst: Instance) -> PrefillJob:
    prompt = list(request.prompt_token_ids)
    check_prompt(prompt, inst.limits)
    params = sampling_from_proto(request.sampling, inst.limits)
    dest = request.destination if request.HasField("destination") else None
    if dest is not None and not dest.address:
        dest = None
    return PrefillJob(rid, prompt, params, request.meta.priority, request.meta.cache_salt, dest)


def _result_to_proto(result: PrefillResult, inst: Instance,
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
        finish_reason=finish_to_proto(result.finish_reason), text=result.text)
    if result.first_logprob is not None and job.params.logprobs is not None:
        out.first_logprobs.CopyFrom(logprobs_to_proto(result.first_token_id,
                                                      result.first_logprob))
    if inst.bridge is not None:
        out.source.CopyFrom(inst.bridge.endpoint)
    return out


def servicers(instance: Instance) -> list[tuple[Any, Any, str]]:
    """(add_fn, servicer, full service name) for every service this process serves."""
    out: list[tuple[Any, Any, str]] = [
        (engine_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(instance),
         "pdserve.v1.Prefill"),
        (engine_pb2_grpc.add_EngineServicer_to_server, EngineAdminServicer(instance),
         "pdserve.v1.Engine"),
    ]
    if instance.is_flex:  # a flex instance may become a decode instance later
        from services.decode.servicer import DecodeServicer

        out.append((engine_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(instance),
                    "pdserve.v1.Decode"))
    return out
