"""gRPC edge of the decode service: proto <-> dataclass conversion, then delegation."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from pdserve.serving.admin import EngineAdminServicer
from pdserve.serving.convert import (
    BadRequest,
    block_refs_from_proto,
    check_prompt,
    finish_to_proto,
    logprobs_to_proto,
    sampling_from_proto,
)
from pdserve.serving.errors import rpc_status
from pdserve.serving.instance import Instance
from pdserve.telemetry import server_span
from services.decode.decode import Chunk, DecodeJob, run_decode


class DecodeServicer(engine_pb2_grpc.DecodeServicer):
    def __init__(self, instance: Instance) -> None:
        self.instance = instance

    async def Decode(self, request: engine_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.DecodeChunk]:
        inst = self.instance
        rid = request.meta.request_id or f"decode-{uuid.uuid4().hex}"
        with server_span("Decode.Decode", context, request_id=rid,
                         prompt_tokens=len(request.prompt_token_ids),
                         num_blocks=len(request.blocks)):
            async with rpc_status(context, "Decode"):
                job = _job_from_proto(request, rid, inst)
                with inst.admit("decode", "colocated"):
                    timeout = _timeout(context, inst.config.kvd_timeout)
                    async for chunk in run_decode(inst, job, timeout):
                        yield _chunk_to_proto(chunk, len(job.prompt))


def _timeout(context: grpc.aio.ServicerContext, default: float) -> float:
    """The kvd wait ends with the rpc's own deadline when that comes first."""
    remaining = context.time_remaining()
    return default if remaining is None else max(0.001, min(default, remaining))


def _job_from_proto(request: engine_pb2.DecodeRequest, rid: str, inst: Instance) -> DecodeJob:
    prompt = list(request.prompt_token_ids)
    check_prompt(prompt, inst.limits)
    params = sampling_from_proto(request.sampling, inst.limits)
    first = request.first_token_id if request.HasField("first_token_id") else None
    if first is not None and first >= inst.limits.vocab_size:
        raise BadRequest(f"first_token_id must be < vocab_size {inst.limits.vocab_size}, "
                         f"got {first}")
    if first is None and request.blocks:
        raise BadRequest("blocks: given without first_token_id (blocks come from a prefill, "
                         "which also returns the first token)")
    salt = request.meta.cache_salt
    blocks = block_refs_from_proto(request.blocks, prompt, inst.block_size,
                                   inst.engine.config.fingerprint, salt)
    source = request.source if request.HasField("source") and request.source.address else None
    return DecodeJob(rid, prompt, params, first, blocks, source, request.meta.priority, salt)


def _chunk_to_proto(chunk: Chunk, num_prompt: int) -> engine_pb2.DecodeChunk:
    out = engine_pb2.DecodeChunk(
        token_ids=chunk.token_ids, text=chunk.text,
        logprobs=[logprobs_to_proto(t, lp) for t, lp in chunk.logprobs],
        finish_reason=finish_to_proto(chunk.finish_reason))
    if chunk.finish_reason is not None:
        out.usage.CopyFrom(common_pb2.Usage(prompt_tokens=num_prompt,
                                            completion_tokens=chunk.completion_tokens,
                                            cached_tokens=chunk.cached_tokens))
    return out


def servicers(instance: Instance) -> list[tuple[Any, Any, str]]:
    """(add_fn, servicer, full service name) for every service this process serves."""
    out: list[tuple[Any, Any, str]] = [
        (engine_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(instance),
         "pdserve.v1.Decode"),
        (engine_pb2_grpc.add_EngineServicer_to_server, EngineAdminServicer(instance),
         "pdserve.v1.Engine"),
    ]
    if instance.is_flex:  # a flex instance may become a prefill instance later
        from services.prefill.servicer import PrefillServicer

        out.append((engine_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(instance),
                    "pdserve.v1.Prefill"))
    return out
