"""What a generic gRPC tool sees on any pdserve service (``pdserve.server.make_server``):
server reflection under v1 and v1alpha, and the health service's ``Check`` and ``Watch``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from pdserve.proto.v1 import router_pb2_grpc
from pdserve.server import Service, make_server

ROUTER = "pdserve.v1.Router"
SERVICES = {ROUTER, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"}
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
async def svc() -> AsyncIterator[Service]:
    service = make_server("127.0.0.1", 0, [(router_pb2_grpc.add_RouterServicer_to_server,
                                            router_pb2_grpc.RouterServicer(), ROUTER)])
    await service.server.start()
    await service.set_serving(True)
    yield service
    await service.server.stop(0)


def _messages(version: str) -> tuple[Any, Any]:
    """The request and response classes of reflection ``version`` (v1: by its own names)."""
    if version == "v1alpha":
        return reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse
    pool = descriptor_pool.Default()
    return tuple(message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"grpc.reflection.v1.{name}"))
        for name in ("ServerReflectionRequest", "ServerReflectionResponse"))


async def _ask(port: int, version: str, **request: Any) -> Any:
    req_cls, resp_cls = _messages(version)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=req_cls.SerializeToString,
            response_deserializer=resp_cls.FromString)
        responses = [r async for r in call(iter([req_cls(**request)]), timeout=5)]
    assert len(responses) == 1
    return responses[0]


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_lists_and_describes(svc: Service, version: str) -> None:
    listed = await _ask(svc.port, version, list_services="")
    assert {s.name for s in listed.list_services_response.service} == SERVICES
    described = {}
    for symbol in (ROUTER, f"grpc.reflection.{version}.ServerReflection"):
        reply = await _ask(svc.port, version, file_containing_symbol=symbol)
        for raw in reply.file_descriptor_response.file_descriptor_proto:
            fdp = descriptor_pb2.FileDescriptorProto.FromString(raw)
            described[fdp.package if fdp.service else fdp.name] = fdp
    router = described["pdserve.v1"].service[0]
    assert [m.name for m in router.method] == ["Generate", "ListModels", "ClusterState",
                                                "Tokenize", "Detokenize"]
    itself = described[f"grpc.reflection.{version}"].service[0]
    assert [m.input_type for m in itself.method] == [
        f".grpc.reflection.{version}.ServerReflectionRequest"]
    missing = await _ask(svc.port, version, file_containing_symbol="no.such.Service")
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


async def test_health_watch_follows_serving_state(svc: Service) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = await health.Check(health_pb2.HealthCheckRequest(service=ROUTER), timeout=5)
        assert check.status == SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=ROUTER), timeout=10)
        assert (await watch.read()).status == SERVING
        await svc.set_serving(False)  # what serve() does on SIGTERM, before stopping
        nxt = await asyncio.wait_for(watch.read(), 5)
        assert nxt.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        unknown = health.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"),
                               timeout=10)
        first = await asyncio.wait_for(unknown.read(), 5)
        assert first.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()
