"""How the gateway reaches the router: one small interface (``RouterApi``), two implementations.

    RouterClient     one persistent ``grpc.aio`` channel to a standalone router (``--router
                     host:port``)
    EmbeddedRouter   the router's core in this process (``--router embedded``;
                     ``services.gateway.embedded``): no gRPC hop, no serialization

Both answer alike: a generation is a ``GenerateCall`` read until ``grpc.aio.EOF``; a failure is
a ``grpc.aio.AioRpcError`` carrying the router's status and rich details. Every call carries a
deadline; a cancelled caller cancels its call (``GenerateCall.cancel``), which the router sees
as the client going away and propagates down to the engines.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.channel import insecure_channel
from pdserve.proto.v1 import router_pb2, router_pb2_grpc


class GenerateCall(Protocol):
    """One streamed generation (``grpc.aio.UnaryStreamCall``'s reading half)."""

    async def read(self) -> Any:
        """The next ``GenerateResponse``, or ``grpc.aio.EOF``; raises AioRpcError."""

    def cancel(self) -> bool:
        """Stop the generation (the router aborts its engine calls); False if it had ended."""


class RouterApi(Protocol):
    """What the gateway asks of the router, over gRPC or in-process."""

    timeout: float  # the default deadline of a generation (seconds)

    async def start(self) -> None: ...

    def generate(self, request: router_pb2.GenerateRequest,
                 metadata: tuple[tuple[str, str], ...] = (),
                 timeout: float | None = None) -> GenerateCall: ...

    async def list_models(self, timeout: float = 5.0) -> list[router_pb2.ModelInfo]: ...

    async def tokenize(self, request: router_pb2.TokenizeRequest,
                       metadata: tuple[tuple[str, str], ...] = ()
                       ) -> router_pb2.TokenizeResponse: ...

    async def detokenize(self, request: router_pb2.DetokenizeRequest,
                         metadata: tuple[tuple[str, str], ...] = (),
                         ) -> router_pb2.DetokenizeResponse: ...

    async def default_model(self) -> str: ...

    async def check(self, timeout: float = 2.0) -> bool: ...

    async def close(self) -> None: ...


def no_model() -> grpc.aio.AioRpcError:
    """The error of a router that serves no model."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                grpc.aio.Metadata(), "router serves no model")


class RouterClient:
    """``RouterApi`` over gRPC: the standalone router (one channel, never resending)."""

    def __init__(self, address: str, timeout: float,
                 credentials: tuple[tuple[str, str], ...] = ()) -> None:
        self.address = address
        self.timeout = timeout
        # Retries are the router's job (on another instance): the channel never resends.
        self._channel = insecure_channel(address, ("grpc.enable_retries", 0),
                                         credentials=credentials)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._default_model: str | None = None

    def generate(self, request: router_pb2.GenerateRequest,
                 metadata: tuple[tuple[str, str], ...] = (),
                 timeout: float | None = None) -> grpc.aio.UnaryStreamCall:
        """Start one streamed generation (deadline ``timeout``, else the client's); read it
        with ``await call.read()``."""
        return self._stub.Generate(request, timeout=timeout or self.timeout,
                                   metadata=metadata or None)

    async def list_models(self, timeout: float = 5.0) -> list[router_pb2.ModelInfo]:
        reply = await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=timeout)
        if reply.models and self._default_model is None:
            self._default_model = reply.models[0].id
        return list(reply.models)

    async def tokenize(self, request: router_pb2.TokenizeRequest,
                       metadata: tuple[tuple[str, str], ...] = ()) -> router_pb2.TokenizeResponse:
        return await self._stub.Tokenize(request, timeout=self.timeout,
                                         metadata=metadata or None)

    async def detokenize(self, request: router_pb2.DetokenizeRequest,
                         metadata: tuple[tuple[str, str], ...] = (),
                         ) -> router_pb2.DetokenizeResponse:
        return await self._stub.Detokenize(request, timeout=self.timeout,
                                           metadata=metadata or None)

    async def default_model(self) -> str:
        """The router's first model (fetched once: the gateway's ``--model-name`` aliases it)."""
        if self._default_model is None:
            models = await self.list_models()
            if not models:
                raise no_model()
        assert self._default_model is not None
        return self._default_model

    async def start(self) -> None:
        """Nothing to start: the channel connects on its first call."""

    async def check(self, timeout: float = 2.0) -> bool:
        """True when the router answers its gRPC health check with SERVING."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""),
                                             timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        await self._channel.close()
