"""gRPC edge of the router service: the work is delegated to ``core.Router``; failures are
``StatusError`` (``pdserve.errors``), answered with their code, message and ``retry-after``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.proto.v1 import router_pb2, router_pb2_grpc
from pdserve.rpc import rpc_handler
from services.router import metrics
from services.router.core import Router


def _count(rpc: str, code: grpc.StatusCode) -> None:
    metrics.REQUESTS.labels(code.name).inc()


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    @rpc_handler("Generate", _count)
    async def Generate(self, request: router_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext,
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        async for message in self.router.generate(request, context.time_remaining):
            yield message

    @rpc_handler("ListModels")
    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsResponse:
        return self.router.list_models()

    @rpc_handler("Tokenize")
    async def Tokenize(self, request: router_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> router_pb2.TokenizeResponse:
        return self.router.tokenize(request)

    @rpc_handler("Detokenize")
    async def Detokenize(self, request: router_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.DetokenizeResponse:
        return self.router.detokenize(request)

    @rpc_handler("ClusterState")
    async def ClusterState(self, request: router_pb2.ClusterStateRequest,
                           context: grpc.aio.ServicerContext) -> router_pb2.ClusterStateResponse:
        return self.router.cluster_state()


def servicers(router: Router) -> list[tuple[Any, Any, str]]:
    """(add_fn, servicer, full service name) for every service this process serves."""
    name = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    return [(router_pb2_grpc.add_RouterServicer_to_server, RouterServicer(router), name)]
