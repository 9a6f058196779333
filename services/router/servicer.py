"""gRPC edge of the router service: status codes and metadata in, proto messages out; the work
is delegated to ``core.Router``."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.proto.v1 import router_pb2, router_pb2_grpc
from services.router import metrics
from services.router.core import Router
from services.router.requests import RouteError


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: router_pb2.GenerateRequest,  # noqa: N802 (gRPC name)
                       context: grpc.aio.ServicerContext,
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        code = grpc.StatusCode.UNKNOWN
        trace_context = metrics.extract_context(context.invocation_metadata())
        try:
            async for message in self.router.generate(request, context.time_remaining,
                                                      trace_context):
                yield message
            code = grpc.StatusCode.OK
        except RouteError as exc:
            code = exc.code
            if exc.retry_after is not None:
                seconds = max(1, math.ceil(exc.retry_after))
                context.set_trailing_metadata((("retry-after", str(seconds)),))
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            metrics.REQUESTS.labels(code.name).inc()

    async def ListModels(self, request: router_pb2.ListModelsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsResponse:
        return self.router.list_models()

    async def ClusterState(self, request: router_pb2.ClusterStateRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> router_pb2.ClusterStateResponse:
        return self.router.cluster_state()


def servicers(router: Router) -> list[tuple[Any, Any, str]]:
    """(add_fn, servicer, full service name) for every service this process serves."""
    name = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    return [(router_pb2_grpc.add_RouterServicer_to_server, RouterServicer(router), name)]
