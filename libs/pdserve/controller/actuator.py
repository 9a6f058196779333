"""Actuators: what carries a ``Plan`` out. One interface, several back-ends:

    InPlaceActuator   flex engines switched over gRPC, one at a time in ``choose_flips``'s
                      order. To colocated: SetRole at once (a colocated engine serves both
                      kinds of call, so what it runs goes on). Otherwise Drain (no new work;
                      the router moves on) → SetRole (the engine hands its queued, unstarted
                      prompts back to the router, waits for its running requests, switches
                      and accepts work again). Stats confirms the new role. Never drops a
                      request.
    DryRunActuator    logs and records each plan, touches nothing
    KubernetesActuator (k8s.py) scales the prefill and decode Deployments

Which engines flip: the least busy of each role that has too many; in which order: so that
some engine can serve at every moment it can be arranged (``choose_flips``).
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
from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc
from pdserve.roles import Role

log = logging.getLogger(__name__)


class ActuationError(RuntimeError):
    """A plan this actuator cannot carry out (or an engine refused a step of it)."""


@dataclass(frozen=True)
class Flip:
    address: str
    to_role: str
    num_in_flight: int  # when its drain began (to colocated, no drain: its queue + running)
    num_handed_back: int = 0  # queued prompts it refused for the router to place elsewhere


class Actuator(abc.ABC):
    """``apply`` makes the cluster run ``plan`` and returns what it changed; it raises
    ``ActuationError`` naming the step that failed. Applying the plan in force is a no-op.
    ``chunk_tokens``: the most prompt tokens a step of an engine switched to colocated may
    carry (0: the engine's own budget), set by the loop from the TPOT SLO; engines switched
    to prefill or decode get their own budget back."""

    chunk_tokens = 0

    @abc.abstractmethod
    async def apply(self, plan: Plan) -> list[Flip]: ...


class DryRunActuator(Actuator):
    def __init__(self) -> None:
        self.applied: list[Plan] = []

    async def apply(self, plan: Plan) -> list[Flip]:
        log.info("controller dry run: would apply", extra={"fields": {"plan": str(plan)}})
        self.applied.append(plan)
        return []


ROLES = ("prefill", "decode", "colocated")  # what a plan counts, in its order
# Which engines a new role takes first: to colocated, decode ones before prefill ones (a
# decode engine's requests are the longest to finish, and it becomes colocated at once); to
# prefill or decode, colocated ones first (the role that serves both kinds goes last).
_SOURCES = {"colocated": ("decode", "prefill"), "prefill": ("colocated", "decode"),
            "decode": ("colocated", "prefill")}


def _load(s: Sample) -> tuple[int, str]:
    return (s.queue_depth + s.num_running, s.address)


def _target_order(need: dict[str, int], have: dict[str, int]) -> list[str]:
    """The roles to fill, in order: colocated first (it takes no drain), then prefill and
    decode alternately, starting with the one fewer engines run now (ties: decode), so both
    exist as early as possible and the router can pair them."""
    order = ["colocated"] * need["colocated"]
    p, d = need["prefill"], need["decode"]
    turn = "prefill" if have["prefill"] < have["decode"] else "decode"
    while p or d:
        if turn == "prefill" and p or not d:
            order.append("prefill")
            p -= 1
        else:
            order.append("decode")
            d -= 1
        turn = "decode" if turn == "prefill" else "prefill"
    return order


def choose_flips(samples: Sequence[Sample], plan: Plan) -> list[tuple[Sample, str]]:
    """Which flex engines to switch, to what, and in which order, for ``samples`` to run
    ``plan`` (a split, colocated, or back). Of a role that has too many engines the least busy
    leave; the order keeps serving capacity wherever it can:

        1P+1D -> 2C     D->C (at once: colocated serves), then P->C (at once)
        2C -> 1P+1D     C->D (the other C serves), then C->P: while it drains only the
                        decode engine is up, so the router holds new requests until the
                        prefill is back (unavoidable with two engines)
        3C -> 2P+1D     C->D, C->P (a P+D pair now serves), C->P
    """
    flex = [s for s in samples if s.is_flex]
    want = {"prefill": plan.num_prefill, "decode": plan.num_decode,
            "colocated": plan.num_colocated}
    if sum(want.values()) != len(flex):
        raise ActuationError(f"in place: plan {plan} needs {sum(want.values())} flex engines, "
                             f"{len(flex)} answered Stats")
    by_role = {r: sorted((s for s in flex if s.role == r), key=_load) for r in ROLES}
    unknown = [s.address for s in flex if s.role not in ROLES]
    if unknown:
        raise ActuationError(f"in place: flex engines {unknown} report no role")
    have = {r: len(by_role[r]) for r in ROLES}
    leaving = {r: by_role[r][:max(0, have[r] - want[r])] for r in ROLES}
    flips = []
    for role in _target_order({r: max(0, want[r] - have[r]) for r in ROLES}, have):
        source = next(r for r in _SOURCES[role] if leaving[r])
        flips.append((leaving[source].pop(0), role))
    return flips


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

    async def _stats(self, address: str) -> engine_pb2.EngineStats:
        stats: engine_pb2.EngineStats = await self.stubs()[address].Stats(
            engine_pb2.EngineStatsRequest(), timeout=self.rpc_timeout_s)
        return stats

    def confirmed(self, address: str, stats: engine_pb2.EngineStats) -> None:
        """A flip's result, as the engine reported it (a subclass may record it)."""

    async def apply(self, plan: Plan) -> list[Flip]:
        """The flips in ``choose_flips``'s order, one at a time (each is short: a drain waits
        only for running requests); a failed one stops the rest, done ones stay done."""
        try:
            stats = await asyncio.gather(*(self._stats(a) for a in self.stubs()))
        except grpc.RpcError as exc:
            raise ActuationError(f"in place: Stats failed: {exc.code().name}: "
                                 f"{exc.details()}") from None
        samples = [sample_from_proto(st, a, 0.0) for st, a in zip(stats, self.stubs(),
                                                                  strict=True)]
        return [await self._flip(s, role) for s, role in choose_flips(samples, plan)]

    async def _flip(self, sample: Sample, role: str) -> Flip:
        address, stub = sample.address, self.stubs()[sample.address]
        step, in_flight = "Drain", sample.queue_depth + sample.num_running
        try:
            if role != "colocated":
                drained = await stub.Drain(engine_pb2.DrainRequest(wait=False),
                                           timeout=self.rpc_timeout_s)
                in_flight = drained.num_in_flight
            step = "SetRole"
            chunk = self.chunk_tokens if role == "colocated" else 0
            switched = await stub.SetRole(engine_pb2.SetRoleRequest(
                role=Role(role).proto, max_prefill_tokens=chunk), timeout=self.drain_timeout_s)
            step = "Stats"
            stats = await self._stats(address)
        except grpc.RpcError as exc:
            raise ActuationError(f"in place: {step} on {address} failed: {exc.code().name}: "
                                 f"{exc.details()}") from None
        after = sample_from_proto(stats, address, 0.0)
        if after.role != role or after.draining:
            raise ActuationError(f"in place: {address} runs {after.role} (draining="
                                 f"{after.draining}) after SetRole {role}")
        self.confirmed(address, stats)
        log.info("flex engine switched", extra={"fields": {
            "address": address, "from_role": sample.role, "role": role,
            "in_flight_at_drain": in_flight, "handed_back": switched.num_handed_back,
            "max_prefill_tokens": stats.max_prefill_tokens}})
        return Flip(address, role, in_flight, switched.num_handed_back)
