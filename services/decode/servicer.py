"""gRPC edge of the decode service: proto <-> dataclass conversion, then delegation."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from pdserve.convert import finish_to_proto, logprobs_to_proto, prompt_logprobs_to_proto
from pdserve.errors import BadRequest
from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from pdserve.roles import Role
from pdserve.rpc import rpc_handler
from pdserve.tokenizer import Tokenizer
from services.decode.decode import Chunk, DecodeJob, run_decode
from services.engine import metrics
from services.engine.convert import check_block_refs, prompt_and_params
from services.engine.instance import EngineInstance, kvd_timeout


class DecodeServicer(engine_pb2_grpc.DecodeServicer):
    def __init__(self, instance: EngineInstance) -> None:
        self.instance = instance

    @rpc_handler("Decode", metrics.count_rpc)
    async def Decode(self, request: engine_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.DecodeChunk]:
        inst = self.instance
        rid = request.meta.request_id or f"decode-{uuid.uuid4().hex}"
        trace.get_current_span().set_attributes(
            {"request_id": rid, "prompt_tokens": len(request.prompt_token_ids),
             "num_blocks": len(request.blocks)})
        job = _job_from_proto(request, rid, inst)
        # A prompt a colocated engine would prefill may start elsewhere until it has run here;
        # a decode of KV made elsewhere never is handed back.
        restartable = rid if job.first_token_id is None else ""
        with inst.admit(Role.DECODE, Role.COLOCATED, restartable=restartable):
            timeout = kvd_timeout(context, inst.config.kvd_timeout)
            async for chunk in run_decode(inst, job, timeout):
                yield _chunk_to_proto(chunk, job.prompt, inst.engine.tokenizer,
                                      inst.engine.model_version)


def _job_from_proto(request: engine_pb2.DecodeRequest, rid: str,
                    inst: EngineInstance) -> DecodeJob:
    prompt, params = prompt_and_params(request.prompt_token_ids, request.sampling, inst.limits)
    first = request.first_token_id if request.HasField("first_token_id") else None
    if first is not None and first >= inst.limits.vocab_size:
        raise BadRequest(f"first_token_id must be < vocab_size {inst.limits.vocab_size}, "
                         f"got {first}")
    if first is None and request.blocks:
        raise BadRequest("blocks: given without first_token_id (blocks come from a prefill, "
                         "which also returns the first token)")
    if request.prior_output and first is None:
        raise BadRequest("prior_output: given without first_token_id (it counts the output "
                         "tokens before the first token)")
    if request.prior_output and request.prior_output >= len(prompt):
        raise BadRequest(f"prior_output must be < the prompt's {len(prompt)} tokens, "
                         f"got {request.prior_output}")
    salt = request.meta.cache_salt
    blocks = check_block_refs(request.blocks, prompt, inst.block_size,
                              inst.engine.fingerprint, salt)
    source = request.source if request.HasField("source") and request.source.address else None
    return DecodeJob(rid, prompt, params, first, blocks, source, request.meta.priority, salt,
                     request.prior_output)


def _chunk_to_proto(chunk: Chunk, prompt: list[int], tokenizer: Tokenizer | None,
                    model_version: str) -> engine_pb2.DecodeChunk:
    out = engine_pb2.DecodeChunk(
        token_ids=chunk.token_ids, text=chunk.text,
        logprobs=[logprobs_to_proto(t, lp, tokenizer) for t, lp in chunk.logprobs],
        finish_reason=finish_to_proto(chunk.finish_reason))
    if chunk.prompt_logprobs is not None:
        out.prompt_logprobs.extend(prompt_logprobs_to_proto(prompt, chunk.prompt_logprobs,
                                                            tokenizer))
    if chunk.finish_reason is not None:
        out.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(prompt),
                                            completion_tokens=chunk.completion_tokens,
                                            cached_tokens=chunk.cached_tokens,
                                            model_version=model_version))
    return out
