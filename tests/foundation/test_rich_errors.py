"""Rich status details (``pdserve.errors``) over a real ``grpc.aio`` server: what every pdserve
service answers, read back the way the client library, the gateway and the router read it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from pdserve.errors import (
    BadRequest,
    FieldViolation,
    StatusDetails,
    StatusError,
    details_of,
)
from pdserve.proto.v1 import router_pb2, router_pb2_grpc
from pdserve.rpc import rpc_handler
from pdserve.server import make_server

FAILURES: dict[str, Exception] = {
    "bad": BadRequest("sampling.top_p must be in (0, 1], got 1.5"),
    "named": BadRequest("the first token is out of range", field="first_token_id"),
    "quota": StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant t: token rate", 2.5),
    "busy": StatusError(grpc.StatusCode.UNAVAILABLE, "no capacity"),
    "missing": StatusError(grpc.StatusCode.NOT_FOUND, "model: 'x' is not served"),
    "bug": RuntimeError("boom"),
}


class Failing(router_pb2_grpc.RouterServicer):
    """Answers each prompt with the failure of that name (the servicer idiom, unchanged)."""

    @rpc_handler("Generate")
    async def Generate(self, request: router_pb2.GenerateRequest, context: Any
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        raise FAILURES[request.prompt]
        yield router_pb2.GenerateResponse()  # a stream


@pytest.fixture
async def stub() -> AsyncIterator[router_pb2_grpc.RouterStub]:
    svc = make_server("127.0.0.1", 0, [(router_pb2_grpc.add_RouterServicer_to_server, Failing(),
                                        "pdserve.v1.Router")])
    await svc.server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
        yield router_pb2_grpc.RouterStub(channel)
    await svc.server.stop(0)


async def _fail(stub: router_pb2_grpc.RouterStub, name: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(router_pb2.GenerateRequest(prompt=name), timeout=10):
            pass
    return err.value


@pytest.mark.parametrize(("name", "code", "details"), [
    ("bad", grpc.StatusCode.INVALID_ARGUMENT, StatusDetails(
        (FieldViolation("sampling.top_p", "must be in (0, 1], got 1.5"),))),
    ("named", grpc.StatusCode.INVALID_ARGUMENT, StatusDetails(
        (FieldViolation("first_token_id", "the first token is out of range"),))),
    ("quota", grpc.StatusCode.RESOURCE_EXHAUSTED, StatusDetails(retry_after=2.5)),
    ("busy", grpc.StatusCode.UNAVAILABLE, StatusDetails(retry_after=1.0)),
    ("missing", grpc.StatusCode.NOT_FOUND, StatusDetails()),
    ("bug", grpc.StatusCode.INTERNAL, StatusDetails()),
])
async def test_every_status_carries_its_details(stub: router_pb2_grpc.RouterStub, name: str,
                                                code: grpc.StatusCode,
                                                details: StatusDetails) -> None:
    err = await _fail(stub, name)
    assert err.code() == code and details_of(err) == details
    failure = FAILURES[name]
    if isinstance(failure, StatusError):
        assert err.details() == failure.message


async def test_retry_hints_in_trailers(stub: router_pb2_grpc.RouterStub) -> None:
    """RetryInfo's delay also goes out as gRPC's pushback; an explicit one as retry-after."""
    quota = dict((await _fail(stub, "quota")).trailing_metadata() or ())
    assert (quota["grpc-retry-pushback-ms"], quota["retry-after"]) == ("2500", "3")
    busy = dict((await _fail(stub, "busy")).trailing_metadata() or ())
    assert busy["grpc-retry-pushback-ms"] == "1000" and "retry-after" not in busy
    bad = dict((await _fail(stub, "bad")).trailing_metadata() or ())
    assert "grpc-retry-pushback-ms" not in bad and "grpc-status-details-bin" in bad


async def test_a_relayed_status_keeps_the_peers_details(stub: router_pb2_grpc.RouterStub
                                                        ) -> None:
    relayed = StatusError.relay(await _fail(stub, "bad"), "prefill on p0")
    assert relayed.code == grpc.StatusCode.INVALID_ARGUMENT
    assert relayed.message == "prefill on p0: sampling.top_p must be in (0, 1], got 1.5"
    assert relayed.violations == (FieldViolation("sampling.top_p",
                                                 "must be in (0, 1], got 1.5"),)
    busy = StatusError.relay(await _fail(stub, "busy"), "decode on d0")
    assert (busy.code, busy.retry_after) == (grpc.StatusCode.UNAVAILABLE, 1.0)


def test_a_status_without_details_reads_as_empty() -> None:
    plain = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                 grpc.aio.Metadata(("retry-after", "3")), "connection refused")
    assert details_of(plain) == StatusDetails()


def test_bad_request_field_comes_from_the_message() -> None:
    assert BadRequest("chat.messages[2].role: 'x' is not a role").violations == (
        FieldViolation("chat.messages[2].role", "'x' is not a role"),)
    assert BadRequest("prompt has 9 tokens").field == "prompt"
