"""Connections to other kvds: gRPC channels (cached per address) with the shared secret on
every call, and the control sockets of the kvds of this host.

A Transfer goes on the Control stream held open to the peer, or, once the peer has named its
control socket in an answer (``TransferResponse.control_socket``) and that socket can be
opened from here (the peer is on this host, run by this user), on that socket: the same
message at about half a gRPC message's cost. A socket that cannot be opened is not tried
again for that peer; one that fails is forgotten, and the peer's next answer names its new one
(a restarted kvd has another).
"""

from __future__ import annotations

import logging
from pathlib import PurePosixPath

import grpc

from pdserve.auth import DATA
from pdserve.channel import insecure_channel
from pdserve.kvd.control import ControlStream, LocalControl
from pdserve.proto.v1 import kvd_pb2, kvd_pb2_grpc
from pdserve.telemetry import outbound_metadata
from services.kvd import segments

log = logging.getLogger(__name__)
_DOWN = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


def is_control_socket(path: str) -> bool:
    """Whether a peer's answer names a kvd control socket (``control_socket.socket_path``):
    this kvd presents its credential only there, not at any path an answer may name."""
    p = PurePosixPath(path)
    return (p.parent == PurePosixPath(segments.SHM_DIR)
            and p.name.startswith(f"{segments.PREFIX}ctl-") and ".." not in p.parts)


class Peers:
    """Stubs to peer kvds; ``is_down`` is the cheap liveness probe the transfer watchdogs use."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.metadata = ((DATA.key, secret),) if secret else ()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._ucx: dict[str, bytes] = {}  # address -> UCX address, as last registered
        self._streams: dict[str, ControlStream] = {}
        self._sockets: dict[str, LocalControl] = {}  # address -> the peer's control socket
        self._unreachable: set[str] = set()  # socket paths that could not be opened from here

    def learn(self, registered: dict[str, bytes]) -> None:
        """The registry as read (address -> UCX worker address)."""
        self._ucx.update(registered)

    def restarted(self, address: str, ucx_address: bytes) -> bool:
        """The kvd at ``address`` registered another UCX worker than ``ucx_address`` (the one
        a transfer uses): it restarted since, and will not send that transfer's blocks."""
        known = self._ucx.get(address)
        return bool(ucx_address) and known is not None and known != ucx_address

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = insecure_channel(address)
            self._channels[address] = ch
        return ch

    def stub(self, address: str) -> kvd_pb2_grpc.KvdStub:
        return kvd_pb2_grpc.KvdStub(self._channel(address))

    async def transfer(self, address: str, req: kvd_pb2.TransferRequest,
                       timeout: float) -> kvd_pb2.TransferResponse:
        """``Transfer`` to the kvd at ``address``, on the Control stream held open to it (one
        message, not a call's setup); fails as the unary rpc would (``grpc.RpcError``)."""
        carrier: ControlStream | LocalControl | None = await self._socket(address)
        if carrier is None:
            carrier = self._streams.get(address)
        if carrier is None:
            carrier = ControlStream(self.stub(address), lambda: outbound_metadata(self.metadata))
            self._streams[address] = carrier
        try:
            resp: kvd_pb2.TransferResponse = await carrier.call("transfer", req, timeout)
        except grpc.aio.AioRpcError as exc:
            if isinstance(carrier, LocalControl) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self._forget(address)  # the peer went: its next answer names its socket
            raise
        path = resp.control_socket
        if (is_control_socket(path) and address not in self._sockets
                and path not in self._unreachable):
            self._sockets[address] = LocalControl(path, self.secret)
        return resp

    async def _socket(self, address: str) -> LocalControl | None:
        """The peer's control socket, open, if it named one that this process can reach."""
        local = self._sockets.get(address)
        if local is None:
            return None
        try:
            await local.open()
        except (OSError, grpc.aio.AioRpcError) as exc:
            self._unreachable.add(local.path)
            await self._forget(address)
            log.info("peer kvd's control socket not reachable; Transfers use the Control rpc",
                     extra={"fields": {"peer": address, "path": local.path, "error": str(exc)}})
            return None
        return local

    async def _forget(self, address: str) -> None:
        local = self._sockets.pop(address, None)
        if local is not None:
            await local.close()

    def is_down(self, address: str) -> bool:
        return self._channel(address).get_state(try_to_connect=True) in _DOWN

    async def close(self) -> None:
        for local in self._sockets.values():
            await local.close()
        self._sockets.clear()
        for stream in self._streams.values():
            await stream.close()
        self._streams.clear()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
