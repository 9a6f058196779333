"""The Engine admin service every engine instance serves: Stats, Drain, SetRole, Abort,
LoadWeights."""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.engine.reload import ReloadPolicy
from pdserve.engine.request import EngineStats as CoreStats
from pdserve.errors import BadRequest
from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc
from pdserve.roles import Role
from pdserve.rpc import rpc_handler
from services.engine.instance import SWITCHABLE, EngineInstance

# Stats waits this long for the engine thread (to count what was queued before it); a longer
# step (a long prefill chunk on a busy CPU) gets the snapshot taken after the last step
# instead: the router's health poll must never time out on a busy engine.
STATS_WAIT_S = 0.25


async def core_stats(inst: EngineInstance) -> CoreStats:
    try:
        return await asyncio.wait_for(inst.aengine.call(lambda e: e.stats()), STATS_WAIT_S)
    except TimeoutError:
        snapshot = inst.aengine.last_stats
        if snapshot is None:  # not started: nothing else to say
            raise
        return snapshot


class EngineAdminServicer(engine_pb2_grpc.EngineServicer):
    SERVICE = "Engine"  # span names: Engine.Drain, ...

    def __init__(self, instance: EngineInstance) -> None:
        self.instance = instance

    @rpc_handler("Stats")
    async def Stats(self, request: engine_pb2.EngineStatsRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.EngineStats:
        inst = self.instance
        core = await core_stats(inst)
        prefill_rate, decode_rate = inst.aengine.window.rates(time.monotonic())
        kvd = inst.bridge.endpoint if inst.bridge is not None else None
        measured = inst.measured
        return engine_pb2.EngineStats(
            instance_id=inst.instance_id, role=inst.role.proto,
            model=inst.model_source, model_version=inst.engine.model_version,
            queue_depth=core.num_waiting, num_running=core.num_running,
            kv_blocks_free=core.num_blocks_free, kv_blocks_used=core.num_blocks_used,
            prefill_tokens_per_s=prefill_rate, decode_tokens_per_s=decode_rate,
            prefix_hit_tokens=core.num_prefix_hit_tokens,
            prefill_tokens_computed=core.num_prefill_tokens, kvd=kvd,
            draining=inst.draining, is_flex=inst.is_flex, block_size=inst.block_size,
            decode_tokens=core.num_decode_tokens, kv_fingerprint=inst.engine.fingerprint,
            max_prefill_tokens=inst.max_prefill_tokens,
            measured_prefill_tokens_per_s=measured.prefill_tokens_per_s if measured else 0.0,
            measured_decode_steps=[engine_pb2.MeasuredStep(batch=b, seconds=s)
                                   for b, s in (measured.decode_steps if measured else ())])

    @rpc_handler("Drain")
    async def Drain(self, request: engine_pb2.DrainRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.DrainResponse:
        remaining = await self.instance.drain(request.wait)
        return engine_pb2.DrainResponse(num_in_flight=remaining)

    @rpc_handler("SetRole")
    async def SetRole(self, request: engine_pb2.SetRoleRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.SetRoleResponse:
        role = Role.from_proto(request.role)
        if role not in SWITCHABLE:
            raise BadRequest("role must be ROLE_PREFILL, ROLE_DECODE or ROLE_COLOCATED")
        num_handed_back = await self.instance.set_role(role, request.max_prefill_tokens)
        return engine_pb2.SetRoleResponse(role=self.instance.role.proto,
                                          num_handed_back=num_handed_back)

    @rpc_handler("Abort")
    async def Abort(self, request: engine_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        if not request.request_id:
            raise BadRequest("request_id must not be empty")
        found = await self.instance.aengine.abort(request.request_id)
        return engine_pb2.AbortResponse(found=found)

    @rpc_handler("LoadWeights")
    async def LoadWeights(self, request: engine_pb2.LoadWeightsRequest,
                          context: grpc.aio.ServicerContext) -> engine_pb2.LoadWeightsResponse:
        if not request.model:
            raise BadRequest("model must not be empty: give a checkpoint directory")
        policy = _POLICIES.get(request.policy)
        if policy is None:
            raise BadRequest(f"policy: unknown ReloadPolicy {request.policy}")
        report = await self.instance.load_weights(request.model, policy, request.resume)
        return engine_pb2.LoadWeightsResponse(
            model_version=self.instance.engine.model_version,
            previous_model_version=report.swap.previous_version,
            kv_fingerprint=self.instance.engine.fingerprint, load_ms=report.load_ms,
            wait_ms=report.wait_ms, swap_ms=report.swap.swap_s * 1e3,
            num_reprefilled=report.swap.num_reprefilled)


_POLICIES = {
    engine_pb2.RELOAD_POLICY_UNSPECIFIED: ReloadPolicy.FINISH,
    engine_pb2.RELOAD_POLICY_FINISH: ReloadPolicy.FINISH,
    engine_pb2.RELOAD_POLICY_REPREFILL: ReloadPolicy.REPREFILL,
}
