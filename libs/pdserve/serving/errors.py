"""One mapping from what can go wrong in an engine rpc to the gRPC status it answers with."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.serving import metrics
from pdserve.serving.async_engine import EngineFailed
from pdserve.serving.convert import BadRequest
from pdserve.serving.instance import Rejected

log = logging.getLogger(__name__)


class Aborted(Exception):
    """The request was aborted (Engine.Abort) while this rpc served it."""


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(exc, BadRequest | ValueError):  # the engine's ValueErrors name the field too
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, Rejected):
        return exc.code, str(exc)
    if isinstance(exc, Aborted):
        return grpc.StatusCode.ABORTED, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):  # from the kvd: its code says what happened
        return exc.code(), f"kvd: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"kvd: {exc or 'timed out'}"
    if isinstance(exc, EngineFailed):
        return grpc.StatusCode.INTERNAL, str(exc)
    return None


@contextlib.asynccontextmanager
async def rpc_status(context: grpc.aio.ServicerContext, rpc: str) -> AsyncIterator[None]:
    """Turn known failures into ``context.abort(code, message)``; count every outcome."""
    try:
        yield
    except grpc.aio.AbortError:
        raise  # the body already chose its status
    except Exception as exc:
        status = _status(exc)
        if status is None:
            metrics.REQUESTS.labels(rpc, "INTERNAL").inc()
            log.exception("rpc failed", extra={"fields": {"rpc": rpc}})
            raise
        metrics.REQUESTS.labels(rpc, status[0].name).inc()
        await context.abort(*status)
    else:
        metrics.REQUESTS.labels(rpc, "ok").inc()
