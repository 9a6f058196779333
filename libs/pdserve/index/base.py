"""The prefix index ABC: which kvd nodes hold which blocks, and the kvd node registry.

Derived, soft state (DESIGN.md §5, §7): a wrong or stale entry costs a cache miss, never a wrong
answer, because kvd verifies every block it hands out. Each kvd writes only its own entries.

Contract of every implementation:
- ``add``/``remove`` a node's blocks; an added entry lives ``ttl_s`` seconds unless re-added.
- ``lookup(hashes)`` -> ``{node_id: n}``: for every node with a live registry record, how many
  LEADING hashes it holds (nodes holding none of the first are left out); one round trip.
- ``register_node(record, ttl)`` writes or refreshes the node's record (the heartbeat);
  ``nodes()`` lists live records.
- ``purge_node(node_id, epoch)`` drops every block entry of the node, unless the registry
  already shows a newer epoch (a newer incarnation's entries are never purged).
Implementations raise ``IndexUnavailable`` when the backing store cannot be reached.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass


class IndexUnavailable(Exception):
    """The backing store (Redis) cannot be reached; callers degrade, they do not fail."""


@dataclass(frozen=True)
class NodeRecord:
    """One kvd as the registry lists it."""

    node_id: str
    address: str  # gRPC control address host:port
    ucx_address: bytes  # UCX worker address (opaque)
    capacity: int  # slots in the pool
    epoch: int  # increases on every start of the kvd
    slot_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("node_id: must not be empty")
        if self.capacity < 0:
            raise ValueError(f"capacity: must be >= 0, got {self.capacity}")

    def to_json(self) -> str:
        d = asdict(self)
        d["ucx_address"] = self.ucx_address.hex()
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeRecord:
        d = json.loads(text)
        d["ucx_address"] = bytes.fromhex(d["ucx_address"])
        return cls(**d)


class PrefixIndex(ABC):
    """See the module docstring for the contract."""

    @abstractmethod
    async def add(self, node_id: str, hashes: Sequence[bytes]) -> None: ...

    @abstractmethod
    async def remove(self, node_id: str, hashes: Sequence[bytes]) -> None: ...

    @abstractmethod
    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]: ...

    @abstractmethod
    async def register_node(self, record: NodeRecord, ttl: float) -> None: ...

    @abstractmethod
    async def nodes(self) -> list[NodeRecord]: ...

    @abstractmethod
    async def purge_node(self, node_id: str, epoch: int) -> int:
        """Drop the node's block entries; return how many (-1 if a newer epoch owns them)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
