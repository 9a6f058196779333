"""The one error idiom of every pdserve gRPC service.

Code that finds a problem raises ``StatusError`` (or ``BadRequest``, its INVALID_ARGUMENT
form, whose message starts with the offending field); each rpc handler is wrapped in
``@rpc_handler(...)``, which answers a StatusError with its code and message (and a
``retry-after`` trailer when it has one). Anything else is a bug or a broken dependency, never
the caller's fault: it is logged with its traceback and the request id, and answered INTERNAL
naming that id.

    @rpc_handler("Prefill")
    async def Prefill(self, request, context): ...          # unary
    @rpc_handler("Decode")
    async def Decode(self, request, context): yield ...     # server streaming
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
OnDone = Callable[[str, grpc.StatusCode], None]


class StatusError(Exception):
    """A failure the caller must see as ``code``; ``retry_after`` seconds, when given, go out
    as trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after


class BadRequest(StatusError, ValueError):
    """The caller's request is invalid; the message names the field (``sampling.top_p ...``).
    A ValueError too, so offline callers of the engine catch it as one."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


def request_id_of(request: Any) -> str:
    """The request id a message carries (``meta.request_id``), or a fresh one for the log."""
    meta = getattr(request, "meta", None)
    rid = getattr(meta, "request_id", "") or getattr(request, "request_id", "")
    return str(rid) if rid else f"unnamed-{uuid.uuid4().hex[:12]}"


async def _answer(exc: BaseException, rpc: str, request: Any,
                  context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """Abort ``context`` with the status ``exc`` stands for; returns that code."""
    if isinstance(exc, StatusError):
        if exc.retry_after is not None:
            seconds = max(1, math.ceil(exc.retry_after))
            context.set_trailing_metadata((("retry-after", str(seconds)),))
        code, message = exc.code, exc.message
    else:
        rid = request_id_of(request)
        log.error("rpc failed with an internal error", exc_info=exc,
                  extra={"fields": {"rpc": rpc, "request_id": rid}})
        code = grpc.StatusCode.INTERNAL
        message = (f"{rpc}: internal error ({type(exc).__name__}) serving request {rid}; "
                   "the service log has the details")
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


@contextlib.asynccontextmanager
async def _idiom(rpc: str, request: Any, context: grpc.aio.ServicerContext,
                 on_done: OnDone | None) -> AsyncIterator[None]:
    code = grpc.StatusCode.CANCELLED  # unless the body ends one way or another below
    try:
        yield
        code = grpc.StatusCode.OK
    except grpc.aio.AbortError:
        code = context.code() or grpc.StatusCode.UNKNOWN  # the body chose it
        raise
    except Exception as exc:  # noqa: BLE001 - the idiom's one catch-all
        code = exc.code if isinstance(exc, StatusError) else grpc.StatusCode.INTERNAL
        await _answer(exc, rpc, request, context)
    finally:
        if on_done is not None:
            on_done(rpc, code)


def rpc_handler(rpc: str, on_done: OnDone | None = None) -> Callable[[F], F]:
    """Wrap a servicer method (unary or server-streaming) in the error idiom above;
    ``on_done(rpc, code)`` is called once per call with its final code (OK included)."""

    def wrap(fn: F) -> F:
        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def stream(self: Any, request: Any,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async with _idiom(rpc, request, context, on_done):
                    async for item in fn(self, request, context):
                        yield item

            return stream  # type: ignore[return-value]

        @functools.wraps(fn)
        async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with _idiom(rpc, request, context, on_done):
                return await fn(self, request, context)
            raise AssertionError("unreachable: the idiom answers every failure by aborting")

        return unary  # type: ignore[return-value]

    return wrap
