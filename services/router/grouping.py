"""Which instances serve a request together: the healthy prefill and decode engines (else
colocated ones) sharing one block fingerprint, and the wait while none is up but some is known
(down, likely restarting)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from pdserve.errors import StatusError
from pdserve.proto.v1 import common_pb2
from services.router.flow import Flow
from services.router.instances import Instance, InstancePool
from services.router.model import ModelSpec


@dataclass
class Group:
    """Instances whose blocks hash alike (one ``kv_fingerprint``), by role."""

    fingerprint: str
    prefills: list[Instance] = field(default_factory=list)
    decodes: list[Instance] = field(default_factory=list)
    colocated: list[Instance] = field(default_factory=list)

    def add(self, role: common_pb2.Role, inst: Instance) -> None:
        members = {common_pb2.ROLE_PREFILL: self.prefills, common_pb2.ROLE_DECODE: self.decodes,
                   common_pb2.ROLE_COLOCATED: self.colocated}
        members[role].append(inst)

    def size(self) -> int:
        return len(self.prefills) + len(self.decodes) + len(self.colocated)


@dataclass
class Groups:
    """The groups of ``pool``'s healthy instances; ``fingerprint_order`` is when each block
    fingerprint was first seen (0, 1, ...), so the newest version wins a tie."""

    pool: InstancePool
    model: ModelSpec
    fingerprint_order: dict[str, int] = field(default_factory=dict)

    async def wait(self, flow: Flow) -> Group:
        """``pick()``, waiting while none is healthy but some instance is known (down,
        likely restarting: the supervisor brings it back) up to the request's wait limits."""
        waited = 0.0
        while True:
            try:
                return self.pick()
            except StatusError as down:
                if all(i.is_healthy for i in self.pool.instances.values()):
                    raise  # nothing is down: nothing to wait for (a role not configured)
                waited = await flow.wait_down(down, waited)

    def pick(self) -> Group:
        """The healthy instances that can serve together: prefill and decode engines (else
        colocated ones) sharing one block fingerprint (so one weights version), the largest
        such group, the newest of equal ones. An engine
        that has not reported its fingerprint is taken to use the model's."""
        groups: dict[str, Group] = {}
        for role in (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_COLOCATED):
            for inst in self.pool.healthy(role):
                fp = inst.stats.kv_fingerprint or self.model.fingerprint
                groups.setdefault(fp, Group(fp)).add(role, inst)
        for fp in groups:  # a rolling reload's new version is seen after the old one
            self.fingerprint_order.setdefault(fp, len(self.fingerprint_order))
        disaggregated = [g for g in groups.values() if g.prefills and g.decodes]
        colocated = [g for g in groups.values() if g.colocated]
        # Equal sizes: the newest version wins, so the old one drains as a reload proceeds.
        best = max(disaggregated or colocated, default=None,
                   key=lambda g: (g.size(), self.fingerprint_order[g.fingerprint]))
        if best is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, self.no_capacity())
        return best

    @staticmethod
    def alive(group: Group) -> tuple[list[Instance], list[Instance]]:
        """The group's instances still healthy (alike blocks only)."""
        return ([p for p in group.prefills if p.is_healthy],
                [d for d in group.decodes or group.colocated if d.is_healthy])

    def no_capacity(self) -> str:
        states = ", ".join(f"{i.instance_id}({'up' if i.is_healthy else 'down'})"
                           for i in self.pool.instances.values()) or "none known"
        return f"no capacity: no healthy prefill+decode pair or colocated engine ({states})"
