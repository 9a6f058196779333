"""The loop of one request across the engines: place it, prefill, relay the decode, waiting
while every instance is busy or down, prefilling again when its KV was lost and going on
elsewhere when a stream broke, and starting over when flex engines switched between colocated
and prefill/decode before any of it ran (steps 4-7 of ``core``; one call each is in ``flow``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from pdserve.errors import StatusError
from pdserve.proto.v1 import common_pb2, router_pb2
from services.router.failover import fail_over
from services.router.flow import (
    Busy,
    Down,
    Flow,
    Interrupted,
    KvLost,
)
from services.router.grouping import Group, Groups
from services.router.instances import Instance, InstancePool
from services.router.phases import prefill_again, relay_decode, run_prefill
from services.router.policy import Choice, RoutingPolicy


class Regroup(Exception):  # noqa: N818 (a signal between two methods, not an error)
    """The request's group changed kind (flex engines switched between colocated and
    prefill/decode) before any of it ran: it starts over on ``group``."""

    def __init__(self, group: Group) -> None:
        super().__init__(group.fingerprint)
        self.group = group


def _is_unstarted_colocated(flow: Flow) -> bool:
    """Placed on a colocated engine, nothing sent yet: a prefill/decode pair can take it whole."""
    return flow.prefill_response is None and flow.resume is None and not flow.sent_ids


@dataclass
class Runner:
    """Runs a request on a group; ``placed`` is told of each first placement (the counters)."""

    policy: RoutingPolicy
    pool: InstancePool
    groups: Groups
    placed: Callable[[Flow], None]

    async def run(self, flow: Flow, group: Group) -> AsyncIterator[router_pb2.GenerateResponse]:
        while True:
            try:
                async for message in self._run_on(flow, group):
                    yield message
                return
            except Regroup as moved:  # nothing ran or was sent yet: start over on the new group
                group = moved.group

    async def _run_on(self, flow: Flow, group: Group,
                      ) -> AsyncIterator[router_pb2.GenerateResponse]:
        prefills, decodes = group.prefills, group.decodes
        first = None
        if prefills and decodes:
            first = await self._prefill(flow, prefills, decodes)
            self.placed(flow)
            if first.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                yield first
                return
        else:
            decodes = group.colocated
            flow.choice = self._place_colocated(flow, decodes)
            self.placed(flow)
        is_kv_lost = False
        while True:
            try:
                async for message in self._decode(flow, decodes, first):
                    yield message
                return
            except KvLost as lost:  # the client has the first token; its KV is gone: once more
                if is_kv_lost:
                    raise
                is_kv_lost = True
                prefills, decodes = self.groups.alive(group)
                await prefill_again(flow, self.policy, self.pool, lost, prefills, decodes)
            except Interrupted as broken:  # part of the answer was sent: go on elsewhere
                prefills, decodes = self.groups.alive(group)
                await fail_over(flow, self.policy, self.pool, broken, prefills, decodes)
            first = None

    async def _prefill(self, flow: Flow, prefills: list[Instance], decodes: list[Instance],
                       ) -> router_pb2.GenerateResponse:
        """Prefill, waiting while every prefill instance answers busy (``Busy``) or is down
        (``Down``: restarting, so the group is looked up again once one is back)."""
        waited = down_waited = 0.0
        while True:
            try:
                return await run_prefill(flow, self.policy, self.pool, prefills, decodes)
            except Busy as busy:
                waited = await flow.wait_busy(busy, waited)
            except Down as down:
                down_waited = await flow.wait_down(down, down_waited)
                group = await self.groups.wait(flow)
                if not (group.prefills and group.decodes):  # flex engines switched to colocated
                    raise Regroup(group) from down
                prefills, decodes = group.prefills, group.decodes

    async def _decode(self, flow: Flow, decodes: list[Instance],
                      first: router_pb2.GenerateResponse | None,
                      ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Relay the decode, waiting while every decode instance answers busy before its
        first chunk (``Busy``); ``first`` goes out once."""
        waited = down_waited = 0.0
        while True:
            try:
                async for message in relay_decode(flow, self.policy, self.pool, decodes, first):
                    if message is first:
                        first = None
                    yield message
                return
            except Busy as busy:
                waited = await flow.wait_busy(busy, waited)
            except Down as down:  # every decode down (restarting): wait for one to be back
                down_waited = await flow.wait_down(down, down_waited)
                group = await self.groups.wait(flow)
                if _is_unstarted_colocated(flow) and not group.colocated:
                    raise Regroup(group) from down  # flex engines switched to prefill/decode
                decodes = group.decodes or group.colocated

    def _place_colocated(self, flow: Flow, decodes: list[Instance]) -> Choice:
        assert flow.query is not None
        choice = self.policy.choose(flow.query, [], decodes)
        if choice is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, self.groups.no_capacity())
        return choice

