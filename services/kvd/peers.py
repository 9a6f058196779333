"""gRPC channels to other kvds (cached per address), with the shared secret on every call."""

from __future__ import annotations

import grpc

from pdserve.auth import DATA
from pdserve.channel import insecure_channel
from pdserve.proto.v1 import kvd_pb2_grpc

_DOWN = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


class Peers:
    """Stubs to peer kvds; ``is_down`` is the cheap liveness probe the transfer watchdogs use."""

    def __init__(self, secret: str) -> None:
        self.metadata = ((DATA.key, secret),) if secret else ()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._ucx: dict[str, bytes] = {}  # address -> UCX address, as last registered

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

    def is_down(self, address: str) -> bool:
        return self._channel(address).get_state(try_to_connect=True) in _DOWN

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
