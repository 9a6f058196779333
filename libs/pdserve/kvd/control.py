"""The engine's side of ``Kvd.Control``: Allocate, Commit, Await and Release as messages on one
connection held open to the kvd, instead of one unary call each (a call's setup is most of a
small transfer's time). Answers come back by id; a failed call raises the
``grpc.aio.AioRpcError`` its unary rpc would have raised (same code and message), so callers
cannot tell the ways apart.

Two carriers of the same messages:

- ``ControlStream``: the ``Control`` rpc, a bidirectional gRPC stream (any kvd, any host);
- ``LocalControl``: the kvd's Unix socket next to its pool (``RegisterResponse.control_socket``),
  for an engine of the kvd's host (it maps the pool, so it is on that host). A message there
  costs a socket write and a read instead of gRPC's HTTP/2 framing and its completion-queue
  thread hops: 0.10–0.16 ms a round trip against 0.37–0.39 ms on this repository's 2-core
  machine (docs/benchmarks.md). Frames are a 4-byte big-endian length and the serialized
  message; the first frame is a ``ControlHello`` with the data credential.

Either opens on first use and again after it ends (the kvd restarted or the connection
dropped); calls in flight when it ends fail with UNAVAILABLE (or the stream's status).
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry import propagate

from pdserve.proto.v1 import kvd_pb2, kvd_pb2_grpc

_CODES = {c.value[0]: c for c in grpc.StatusCode}
_HEADER = struct.Struct("!I")
MAX_FRAME = 64 * 1024 * 1024  # as gRPC's message limit on these planes (pdserve.channel)
HELLO_TIMEOUT = 5.0
M = TypeVar("M", bound=Message)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def answered_error(resp: kvd_pb2.ControlResponse) -> grpc.aio.AioRpcError:
    """The error a ``ControlError`` answer stands for (what the unary rpc would raise)."""
    return rpc_error(_CODES.get(resp.error.code, grpc.StatusCode.UNKNOWN), resp.error.message)


class FrameError(Exception):
    """A frame that is not a well-formed message of the expected type, or over ``MAX_FRAME``."""


def frame(message: Message) -> bytes:
    body = message.SerializeToString()
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, cls: type[M]) -> M | None:
    """The next message, or None at a clean end of the connection (between frames)."""
    try:
        head = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("connection ended inside a frame header") from exc
        return None
    (size,) = _HEADER.unpack(head)
    if size > MAX_FRAME:
        raise FrameError(f"frame of {size} bytes is over the {MAX_FRAME}-byte limit")
    try:
        return cls.FromString(await reader.readexactly(size))
    except asyncio.IncompleteReadError as exc:
        raise FrameError(f"connection ended inside a {size}-byte frame") from exc
    except DecodeError as exc:
        raise FrameError(f"frame is not a {cls.DESCRIPTOR.name}: {exc}") from exc


class _Ended(Exception):
    """The connection is gone; ``error`` is what its calls fail with."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(error.details())
        self.error = error


class _Multiplexed:
    """Calls by id over one connection: ``_send`` writes a request, ``_deliver`` hands an answer
    to its caller, ``_fail_pending`` ends every call still waiting."""

    def __init__(self) -> None:
        self._pending: dict[int, asyncio.Future[kvd_pb2.ControlResponse]] = {}
        self._ids = itertools.count(1)
        self._write = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None  # hands answers to their callers

    async def _send(self, req: kvd_pb2.ControlRequest) -> None:
        raise NotImplementedError

    def _disconnect(self) -> None:
        """End the connection (its reader then ends too, failing the calls still waiting)."""
        raise NotImplementedError

    async def close(self) -> None:
        self._disconnect()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def call(self, field: str, message: Any, timeout: float) -> Any:
        """Send ``message`` as the request's ``field``; its answer (that field), or the
        call's error, or DEADLINE_EXCEEDED after ``timeout`` seconds."""
        rid = next(self._ids)
        fut: asyncio.Future[kvd_pb2.ControlResponse] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        req = kvd_pb2.ControlRequest(id=rid, timeout_ms=max(1, int(timeout * 1000)))
        getattr(req, field).CopyFrom(message)
        propagate.inject(req.trace_context)  # the kvd's span of this call is the caller's child
        try:
            async with self._write:
                await self._send(req)
            async with asyncio.timeout(timeout):
                resp = await fut
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except _Ended as exc:
            raise exc.error from exc
        finally:
            self._pending.pop(rid, None)
        if resp.WhichOneof("result") == "error":
            raise answered_error(resp)
        return getattr(resp, field)

    def _deliver(self, resp: kvd_pb2.ControlResponse) -> None:
        fut = self._pending.get(resp.id)
        if fut is not None and not fut.done():
            fut.set_result(resp)

    def _fail_pending(self, err: grpc.aio.AioRpcError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)


class ControlStream(_Multiplexed):
    """One ``Control`` stream to a kvd, shared by every call of one client."""

    def __init__(self, stub: kvd_pb2_grpc.KvdStub,
                 metadata: Callable[[], tuple[tuple[str, str], ...]]) -> None:
        super().__init__()
        self._stub = stub
        self._metadata = metadata
        self._call: Any = None

    async def _send(self, req: kvd_pb2.ControlRequest) -> None:
        try:
            if self._call is None:
                self._call = self._stub.Control(metadata=self._metadata())
                self._reader = asyncio.ensure_future(self._read(self._call))
            await self._call.write(req)
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:  # it ended meanwhile
            self._call = None
            raise _Ended(rpc_error(grpc.StatusCode.UNAVAILABLE,
                                   f"kvd control stream: {exc}")) from exc

    async def _read(self, call: Any) -> None:
        err = rpc_error(grpc.StatusCode.UNAVAILABLE, "kvd control stream ended")
        try:
            async for resp in call:
                self._deliver(resp)
        except grpc.aio.AioRpcError as exc:
            err = exc
        finally:
            if self._call is call:
                self._call = None
            self._fail_pending(err)

    def _disconnect(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()


class LocalControl(_Multiplexed):
    """The same calls on the kvd's Unix control socket at ``path``, presenting ``secret``."""

    def __init__(self, path: str, secret: str = "") -> None:
        super().__init__()
        self.path = path
        self._secret = secret
        self._writer: asyncio.StreamWriter | None = None
        self._opening = asyncio.Lock()

    async def open(self) -> None:
        """Connect and present the credential (if not connected). ``OSError`` when the
        socket cannot be reached from here; the kvd's refusal as its ``AioRpcError``."""
        if self._writer is not None:  # every message asks: the common case takes no lock
            return
        async with self._opening:  # callers at once share one connection
            if self._writer is None:
                await self._connect()

    async def _connect(self) -> None:
        reader, writer = await asyncio.open_unix_connection(self.path)
        try:
            writer.write(frame(kvd_pb2.ControlHello(secret=self._secret)))
            answer = await asyncio.wait_for(read_frame(reader, kvd_pb2.ControlResponse),
                                            HELLO_TIMEOUT)
        except (OSError, FrameError, TimeoutError) as exc:
            writer.close()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                            f"kvd control socket {self.path}: no answer to the hello "
                            f"({type(exc).__name__}: {exc})") from exc
        if answer is None:
            writer.close()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                            f"kvd control socket {self.path}: closed at the hello")
        if answer.WhichOneof("result") == "error":
            writer.close()
            raise answered_error(answer)
        self._writer = writer
        self._reader = asyncio.ensure_future(self._read(reader, writer))

    async def _send(self, req: kvd_pb2.ControlRequest) -> None:
        try:
            await self.open()
            assert self._writer is not None
            self._writer.write(frame(req))
            await self._writer.drain()
        except OSError as exc:
            self._disconnect()
            raise _Ended(rpc_error(grpc.StatusCode.UNAVAILABLE,
                                   f"kvd control socket {self.path}: {exc}")) from exc

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        err = rpc_error(grpc.StatusCode.UNAVAILABLE,
                        f"kvd control socket {self.path}: the kvd closed the connection")
        try:
            while (resp := await read_frame(reader, kvd_pb2.ControlResponse)) is not None:
                self._deliver(resp)
        except (OSError, FrameError) as exc:
            err = rpc_error(grpc.StatusCode.UNAVAILABLE,
                            f"kvd control socket {self.path}: {exc}")
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()
            self._fail_pending(err)

    def _disconnect(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()  # its reader reads the end of the stream and returns
