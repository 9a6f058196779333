"""Limits a slow or silent peer cannot stretch, on both sides of the gateway.

    headers   a connection must deliver its request line and headers within
              ``--header-timeout`` seconds (``with_header_timeout``: uvicorn's h11 or
              httptools protocol with a timer): else 408 and the connection is closed
    body      every chunk of the body must arrive within ``--body-timeout`` seconds of the
              last (``read_body``), and the body stays under ``--max-body-bytes``: a body that
              declares 1,000 bytes and sends 8 is answered 408 in seconds, not held
    deadline  ``X-Request-Timeout: <seconds>`` bounds one request end to end (the router
              call's gRPC deadline; never above ``--request-timeout``)
    silence   a stream waiting for its next token sends an SSE comment (``: keep-alive``)
              every ``--sse-heartbeat`` seconds (``with_heartbeats``), so clients and proxies
              can tell a slow answer from a dead connection
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.errors import ApiError, bad_request

T = TypeVar("T")
HEARTBEAT = b": keep-alive\n\n"
TIMEOUT_HEADER = "x-request-timeout"


class _HeaderTimer:
    """Mixed into one of uvicorn's HTTP protocols: closes connections whose headers do not
    arrive in time. Its request cycle starts when the headers are in: from ``handle_events``
    (h11) or ``on_headers_complete`` (httptools), whichever the protocol has."""

    header_timeout: float = 10.0  # set per server by ``with_header_timeout``
    loop: asyncio.AbstractEventLoop
    cycle: Any
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._header_timer: asyncio.TimerHandle | None = self.loop.call_later(
            self.header_timeout, self._headers_late)

    def handle_events(self) -> None:  # h11
        super().handle_events()  # type: ignore[misc]
        self._headers_in()

    def on_headers_complete(self) -> None:  # httptools
        super().on_headers_complete()  # type: ignore[misc]
        self._headers_in()

    def _headers_in(self) -> None:
        if self.cycle is not None and self._header_timer is not None:
            self._header_timer.cancel()  # the request line and headers are in
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is not None or self.transport.is_closing():
            return
        body = json.dumps({"error": {
            "message": f"request headers: not received within {self.header_timeout:g}s "
                       "(--header-timeout)", "type": "invalid_request_error", "param": None,
            "code": "header_timeout"}}).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json"
                             b"\r\nconnection: close\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.transport.close()


class HeaderTimeoutProtocol(_HeaderTimer, H11Protocol):
    """uvicorn's h11 protocol, closing connections whose headers do not arrive in time."""


def with_header_timeout(seconds: float, parser: str = "h11") -> type[asyncio.Protocol]:
    """The protocol class for one server (uvicorn builds it from the class): ``parser`` h11
    (pure Python) or httptools (C, the ``fast`` extra)."""
    base: type[asyncio.Protocol] = HeaderTimeoutProtocol
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = type("HttpToolsHeaderTimeoutProtocol", (_HeaderTimer, HttpToolsProtocol), {})
    return type(base.__name__, (base,), {"header_timeout": seconds})


async def read_body(request: Request, limit: int, idle_timeout: float) -> bytes:
    """The whole body, refused (413) past ``limit`` bytes, cut off (408) when a chunk takes
    more than ``idle_timeout`` seconds to come."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body: larger than {limit} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    while True:
        try:
            async with asyncio.timeout(idle_timeout):  # in this task: no task per chunk
                chunk = await anext(stream)
        except StopAsyncIteration:
            break
        except TimeoutError:
            of = f" of the {declared} declared" if declared is not None else ""
            raise ApiError(408, f"request body: {size}{of} bytes received, then nothing for "
                           f"{idle_timeout:g}s (--body-timeout)", code="body_timeout",
                           headers={"Connection": "close"}) from None
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body: larger than {limit} bytes",
                           code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def request_timeout(headers: Any, ceiling: float) -> float:
    """The request's deadline in seconds: ``X-Request-Timeout`` when given, at most
    ``ceiling`` (``--request-timeout``)."""
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return ceiling
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise bad_request(f"X-Request-Timeout: must be a number of seconds > 0, got {raw!r}",
                          "X-Request-Timeout")
    return min(value, ceiling)


async def with_heartbeats(items: AsyncIterator[T], interval: float,
                          ) -> AsyncIterator[T | None]:
    """``items``, with a None every ``interval`` seconds that passes without one."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(items.__anext__())
            done, _ = await asyncio.wait((pending,), timeout=interval)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
