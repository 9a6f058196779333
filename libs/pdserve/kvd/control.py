"""The engine's side of ``Kvd.Control``: Allocate, Commit, Await and Release as messages on one
stream held open to the kvd, instead of one unary call each (a call's setup is most of a small
transfer's time). Answers come back by id; a failed call raises the ``grpc.aio.AioRpcError``
its unary rpc would have raised (same code and message), so callers cannot tell the two apart.

The stream opens on first use and again after it ends (the kvd restarted or the channel
dropped); calls in flight when it ends fail with its status.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import grpc
from opentelemetry import propagate

from pdserve.proto.v1 import kvd_pb2, kvd_pb2_grpc

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class ControlStream:
    """One ``Control`` stream to a kvd, shared by every call of one client."""

    def __init__(self, stub: kvd_pb2_grpc.KvdStub,
                 metadata: Callable[[], tuple[tuple[str, str], ...]]) -> None:
        self._stub = stub
        self._metadata = metadata
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[kvd_pb2.ControlResponse]] = {}
        self._ids = itertools.count(1)
        self._write = asyncio.Lock()

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
                if self._call is None:
                    self._open()
                await self._call.write(req)
            resp = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:  # it ended meanwhile
            self._call = None
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"kvd control stream: {exc}") from exc
        finally:
            self._pending.pop(rid, None)
        if resp.WhichOneof("result") == "error":
            raise rpc_error(_CODES.get(resp.error.code, grpc.StatusCode.UNKNOWN),
                            resp.error.message)
        return getattr(resp, field)

    def _open(self) -> None:
        self._call = self._stub.Control(metadata=self._metadata())
        self._reader = asyncio.ensure_future(self._read(self._call))

    async def _read(self, call: Any) -> None:
        err = rpc_error(grpc.StatusCode.UNAVAILABLE, "kvd control stream ended")
        try:
            async for resp in call:
                fut = self._pending.get(resp.id)
                if fut is not None and not fut.done():
                    fut.set_result(resp)
        except grpc.aio.AioRpcError as exc:
            err = exc
        finally:
            if self._call is call:
                self._call = None
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(err)

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
