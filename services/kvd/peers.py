"""gRPC channels to other kvds (cached per address), with the shared secret on every call."""

from __future__ import annotations

import grpc

from pdserve.auth import DATA
from pdserve.channel import insecure_channel
from pdserve.kvd.control import ControlStream
from pdserve.proto.v1 import kvd_pb2, kvd_pb2_grpc
from pdserve.telemetry import outbound_metadata

_DOWN = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


class Peers:
    """Stubs to peer kvds; ``is_down`` is the cheap liveness probe the transfer watchdogs use."""

    def __init__(self, secret: str) -> None:
        self.metadata = ((DATA.key, secret),) if secret else ()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._ucx: dict[str, bytes] = {}  # address -> UCX address, as last registered
        self._streams: dict[str, ControlStream] = {}

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
        stream = self._streams.get(address)
        if stream is None:
            stream = ControlStream(self.stub(address), lambda: outbound_metadata(self.metadata))
            self._streams[address] = stream
        resp: kvd_pb2.TransferResponse = await stream.call("transfer", req, timeout)
        return resp

    def is_down(self, address: str) -> bool:
        return self._channel(address).get_state(try_to_connect=True) in _DOWN

    async def close(self) -> None:
        for stream in self._streams.values():
            await stream.close()
        self._streams.clear()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
