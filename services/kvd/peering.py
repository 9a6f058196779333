"""Which kvd nodes this one deals with: the registry of peers (the index's nodes and
--peers) checked before any push, pull or Transfer, and the checks on a peer's Transfer."""

from __future__ import annotations

import contextlib

import grpc

from pdserve.errors import BadRequest, StatusError
from pdserve.index import IndexUnavailable, NodeRecord, PrefixIndex
from pdserve.kvd import layout as L
from pdserve.proto.v1 import common_pb2, kvd_pb2
from services.kvd.peers import Peers


class PeerGate:
    """The registered kvd nodes (address -> UCX address) and the check against them."""

    def __init__(self, index: PrefixIndex | None, peers: Peers, static: tuple[str, ...]) -> None:
        self.me = common_pb2.KvdEndpoint()  # set by ``Kvd.start`` once the port is bound
        self.registered: dict[str, bytes] = {}  # the index's kvds: address -> UCX address
        self._index = index
        self._peers = peers
        self._static = static  # --peers

    def learn_nodes(self, nodes: list[NodeRecord]) -> None:
        """Add the registry as read at a heartbeat. A node whose record lapsed (partitioned,
        or its link just back and not re-registered yet) stays known: refusing it would fail
        requests routed to it; a re-registered node's new UCX address replaces its old one."""
        self.registered.update({n.address: n.ucx_address for n in nodes})
        self._peers.learn(self.registered)

    async def check(self, peer: common_pb2.KvdEndpoint, field: str,
                    ucx_address: bytes = b"") -> None:
        """Only registered kvd nodes (the index's registry, or --peers) are pushed to, pulled
        from or sent to: a forged address would get blocks (and this kvd's credential), or
        hand it forged bytes. With ``ucx_address``, it must be the registered node's own.
        PERMISSION_DENIED otherwise."""
        if peer.address == self.me.address or peer.address in self._static:
            return
        known = self.registered.get(peer.address)
        if (known is None or ucx_address and known != ucx_address) and self._index is not None:
            with contextlib.suppress(IndexUnavailable):  # then what is unknown stays refused
                self.registered = {n.address: n.ucx_address for n in await self._index.nodes()}
            known = self.registered.get(peer.address)
        if known is None:
            raise StatusError(grpc.StatusCode.PERMISSION_DENIED,
                              f"{field}: {peer.address} is not a registered kvd node (not in "
                              "the prefix index's node registry, not in --peers)")
        if ucx_address and known != ucx_address:
            raise StatusError(grpc.StatusCode.PERMISSION_DENIED,
                              f"{field}: the UCX address given for {peer.address} is not the "
                              "one that node registered")


def check_transfer(req: kvd_pb2.TransferRequest, slot_bytes: int,
                   layout: L.BlockLayout | None) -> None:
    """A peer's Transfer request is well formed and fits this pool (the peer itself is
    checked by ``PeerGate.check``)."""
    if req.slot_bytes != slot_bytes:
        raise BadRequest(f"slot_bytes: peer blocks are {req.slot_bytes} bytes, ours "
                         f"{slot_bytes}")
    if req.kv_dtype and layout is not None and req.kv_dtype != layout.dtype:
        raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"kv_dtype: peer blocks are {req.kv_dtype}, this pool holds "
                          f"{layout.dtype}; quantized and unquantized KV caches never "
                          "exchange blocks")
    if len(req.slots) != len(req.blocks):
        raise BadRequest(f"slots: {len(req.slots)} slots for {len(req.blocks)} blocks")
    if not req.peer.node_id or not req.peer.address or not req.ucx_address:
        raise BadRequest("peer: node_id, address and ucx_address are required")
