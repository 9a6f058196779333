"""Engine roles, mirroring ``common.proto``'s ``Role``; ``flex`` is a capability, not a role.

A flex engine runs prefill, decode or colocated at any one time and may be switched
(``Engine.SetRole``); it reports the role it runs now (``Engine.Stats``), and announces itself
as ``flex`` in the registry.
"""

from __future__ import annotations

import enum

from pdserve.proto.v1 import common_pb2


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    FLEX = "flex"

    @property
    def proto(self) -> common_pb2.Role:
        """The wire value; flex has none of its own (its current role is what it reports)."""
        return _TO_PROTO.get(self, common_pb2.ROLE_UNSPECIFIED)

    @classmethod
    def from_proto(cls, value: common_pb2.Role) -> Role | None:
        return _FROM_PROTO.get(value)


_TO_PROTO: dict[Role, common_pb2.Role] = {
    Role.PREFILL: common_pb2.ROLE_PREFILL,
    Role.DECODE: common_pb2.ROLE_DECODE,
    Role.COLOCATED: common_pb2.ROLE_COLOCATED,
}
_FROM_PROTO: dict[common_pb2.Role, Role] = {v: k for k, v in _TO_PROTO.items()}
