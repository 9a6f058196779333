"""Actuators: what carries a ``Plan`` out. One interface, several back-ends:

    InPlaceActuator   flex engines switched over gRPC: Drain (no new work; the router moves
                      on) → SetRole (the engine waits for its in-flight requests, switches and
                      accepts work again) → Stats confirms the new role; never drops a request
    DryRunActuator    logs and records each plan, touches nothing
    KubernetesActuator (k8s.py) scales the prefill and decode Deployments

Which engines flip: the least busy (queue + running) of the role that has too many.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pdserve import auth
from pdserve.channel import insecure_channel
from pdserve.controller.monitor import Sample, sample_from_proto
from pdserve.controller.optimizer import Plan
from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)


class ActuationError(RuntimeError):
    """A plan this actuator cannot carry out (or an engine refused a step of it)."""


@dataclass(frozen=True)
class Flip:
    address: str
    to_role: str
    num_in_flight: int  # when its drain began


class Actuator(abc.ABC):
    """``apply`` makes the cluster run ``plan`` and returns what it changed; it raises
    ``ActuationError`` naming the step that failed. Applying the plan in force is a no-op."""

    @abc.abstractmethod
    async def apply(self, plan: Plan) -> list[Flip]: ...


class DryRunActuator(Actuator):
    def __init__(self) -> None:
        self.applied: list[Plan] = []

    async def apply(self, plan: Plan) -> list[Flip]:
        log.info("controller dry run: would apply", extra={"fields": {"plan": str(plan)}})
        self.applied.append(plan)
        return []


def choose_flips(samples: Sequence[Sample], plan: Plan) -> list[tuple[Sample, str]]:
    """Which flex engines to switch, and to what, for ``samples`` to run ``plan``."""
    if plan.is_colocated:
        raise ActuationError("in place: flex engines switch between prefill and decode only; a "
                             "colocated plan needs colocated engines (exclude it with "
                             "allow_colocated=False)")
    flex = [s for s in samples if s.is_flex]
    if plan.num_prefill + plan.num_decode != len(flex):
        raise ActuationError(f"in place: plan {plan} needs {plan.num_prefill + plan.num_decode} "
                             f"flex engines, {len(flex)} answered Stats")
    prefill = [s for s in flex if s.role == "prefill"]
    decode = [s for s in flex if s.role == "decode"]
    by_load = sorted(prefill if len(prefill) > plan.num_prefill else decode,
                     key=lambda s: (s.queue_depth + s.num_running, s.address))
    excess = abs(len(prefill) - plan.num_prefill)
    to_role = "decode" if len(prefill) > plan.num_prefill else "prefill"
    return [(s, to_role) for s in by_load[:excess]]


_PROTO_ROLE = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}


class InPlaceActuator(Actuator):
    """Switches flex engines (their admin credential presented on every call)."""

    def __init__(self, addresses: Sequence[str], rpc_timeout_s: float = 5.0,
                 drain_timeout_s: float = 300.0,
                 credentials: Sequence[tuple[str, str]] | None = None) -> None:
        if not addresses:
            raise ValueError("InPlaceActuator: no engine addresses")
        creds = auth.metadata((auth.DATA, auth.ADMIN)) if credentials is None else credentials
        self.rpc_timeout_s, self.drain_timeout_s = rpc_timeout_s, drain_timeout_s
        self._channels = {a: insecure_channel(a, credentials=creds) for a in addresses}
        self._stubs = {a: engine_pb2_grpc.EngineStub(c) for a, c in self._channels.items()}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    def stubs(self) -> dict[str, engine_pb2_grpc.EngineStub]:
        """The engines this actuator may switch, by address (a subclass may compute them)."""
        return self._stubs

    async def _stats(self, address: str) -> Sample:
        stats = await self.stubs()[address].Stats(engine_pb2.EngineStatsRequest(),
                                                 timeout=self.rpc_timeout_s)
        return sample_from_proto(stats, address, 0.0)

    async def apply(self, plan: Plan) -> list[Flip]:
        try:
            samples = await asyncio.gather(*(self._stats(a) for a in self.stubs()))
        except grpc.RpcError as exc:
            raise ActuationError(f"in place: Stats failed: {exc.code().name}: "
                                 f"{exc.details()}") from None
        flips = choose_flips(samples, plan)
        return list(await asyncio.gather(*(self._flip(s.address, r) for s, r in flips)))

    async def _flip(self, address: str, role: str) -> Flip:
        stub = self.stubs()[address]
        step = "Drain"
        try:
            drained = await stub.Drain(engine_pb2.DrainRequest(wait=False),
                                       timeout=self.rpc_timeout_s)
            step = "SetRole"
            await stub.SetRole(engine_pb2.SetRoleRequest(role=_PROTO_ROLE[role]),
                               timeout=self.drain_timeout_s)
            step = "Stats"
            after = await self._stats(address)
        except grpc.RpcError as exc:
            raise ActuationError(f"in place: {step} on {address} failed: {exc.code().name}: "
                                 f"{exc.details()}") from None
        if after.role != role or after.draining:
            raise ActuationError(f"in place: {address} runs {after.role} (draining="
                                 f"{after.draining}) after SetRole {role}")
        log.info("flex engine switched", extra={"fields": {
            "address": address, "role": role, "in_flight_at_drain": drained.num_in_flight}})
        return Flip(address, role, drained.num_in_flight)
