"""Limits a slow or silent peer cannot stretch (``services.gateway.limits``): header and body
timeouts on raw sockets, X-Request-Timeout, SSE keep-alives, mid-stream error labels; a real
gateway in front of the scripted router."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.errors import from_rpc_error
from services.gateway.server import GatewayServer
from tests.gateway.conftest import Stack, _start_gateway


@pytest.fixture(scope="module", params=["h11", "httptools"])  # both parsers keep the limits
def strict(request: pytest.FixtureRequest, stack: Stack) -> Iterator[GatewayServer]:
    config = GatewayConfig(port=0, router=stack.router_address, request_timeout=10,
                           header_timeout=1.0, body_timeout=1.0, sse_heartbeat=0.2,
                           http=request.param)
    gw = stack.loop.run(_start_gateway(config))
    yield gw
    stack.loop.run(gw.stop())


def _raw(port: int, data: bytes, wait: float = 5.0) -> tuple[float, bytes]:
    """Send ``data``, then read until the server closes; (seconds taken, response)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        start = time.monotonic()
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return time.monotonic() - start, out


def _error(response: bytes) -> dict[str, object]:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]  # type: ignore[no-any-return]


def test_a_body_that_stops_short_is_cut_off_with_408(strict: GatewayServer) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    took, response = _raw(strict.http_port, head + b'{"model"')
    assert response.startswith(b"HTTP/1.1 408")
    assert 0.9 < took < 3.0
    error = _error(response)
    assert error["message"] == ("request body: 8 of the 1000 declared bytes received, then "
                                "nothing for 1s (--body-timeout)")
    assert error["code"] == "body_timeout"


def test_headers_that_never_finish_are_cut_off_with_408(strict: GatewayServer) -> None:
    took, response = _raw(strict.http_port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert response.startswith(b"HTTP/1.1 408")
    assert 0.9 < took < 3.0
    error = _error(response)
    assert error["message"] == "request headers: not received within 1s (--header-timeout)"
    assert error["code"] == "header_timeout"


def _post(gw: GatewayServer, body: dict[str, object], **headers: str) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{gw.http_port}/v1/completions", json=body,
                      headers=headers, timeout=10)


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf", "nan"])
def test_a_bad_request_timeout_header_names_itself(strict: GatewayServer, value: str) -> None:
    r = _post(strict, {"prompt": "hi", "max_tokens": 2}, **{"X-Request-Timeout": value})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"X-Request-Timeout: must be a number of seconds > 0, got {value!r}")
    assert r.json()["error"]["param"] == "X-Request-Timeout"


def test_request_timeout_header_bounds_the_request(strict: GatewayServer, stack: Stack) -> None:
    start = time.monotonic()
    r = _post(strict, {"prompt": "hang", "max_tokens": 5}, **{"X-Request-Timeout": "0.5"})
    assert time.monotonic() - start < 3
    assert r.status_code == 504
    error = r.json()["error"]
    assert error["message"].startswith("request timed out after 0.5s (X-Request-Timeout, at "
                                       "most --request-timeout)")
    assert error["code"] == "deadline_exceeded"


def test_a_silent_stream_sends_keep_alive_comments(strict: GatewayServer) -> None:
    lines: list[str] = []
    url = f"http://127.0.0.1:{strict.http_port}/v1/completions"
    with httpx.stream("POST", url, json={"prompt": "hang", "max_tokens": 5, "stream": True},
                      timeout=10) as r:
        for line in r.iter_lines():
            lines.append(line)
            if lines.count(": keep-alive") >= 2:
                break
    data = [x for x in lines if x.startswith("data: ")]
    assert data, "the first token went out before the silence"
    assert lines.index(": keep-alive") > lines.index(data[0])


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_a_failure_mid_stream_is_not_called_no_capacity() -> None:
    exc = _rpc_error(grpc.StatusCode.UNAVAILABLE, "decode on d0 failed after 3 tokens were sent")
    assert from_rpc_error(exc).code == "no_capacity"  # before any output: it is
    mid = from_rpc_error(exc, started=True)
    assert (mid.status, mid.code) == (503, "stream_interrupted")
    assert mid.message == "decode on d0 failed after 3 tokens were sent"


def test_a_stream_waiting_for_its_first_token_sends_keep_alives(strict: GatewayServer,
                                                                stack: Stack) -> None:
    url = f"http://127.0.0.1:{strict.http_port}/v1/completions"
    lines: list[str] = []
    with httpx.stream("POST", url, json={"prompt": "hangfirst", "max_tokens": 5,
                                         "stream": True}, timeout=10) as r:
        assert r.status_code == 200  # still waiting after one heartbeat: committed, kept alive
        for line in r.iter_lines():
            lines.append(line)
            if lines.count(": keep-alive") >= 2:
                break
    assert not [x for x in lines if x.startswith("data: ")]
    deadline = time.monotonic() + 5
    while len(stack.router.cancelled) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.router.cancelled, "the client left: its router call was cancelled"


def test_an_early_refusal_keeps_its_http_status_when_streaming(strict: GatewayServer) -> None:
    r = _post(strict, {"prompt": "quota", "max_tokens": 2, "stream": True})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "7"
    assert r.json()["error"]["message"] == "tenant token rate exceeded"
