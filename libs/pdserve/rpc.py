"""Every pdserve rpc handler in one idiom: ``@rpc_handler("Prefill")`` around a servicer method
(unary or server-streaming) gives it

    errors   a ``StatusError`` becomes its status and rich details (``pdserve.errors``);
             anything else is logged with its traceback and answered INTERNAL naming the
             request id, never blamed on the caller
    a span   a server span continuing the caller's W3C trace (``traceparent`` metadata),
             current while the handler runs, so its own outbound calls are its children;
             named ``<service>.<rpc>`` (the servicer's ``SERVICE``, else its class name)
    a count  ``on_done(rpc, code)`` once per call with its final code (OK included)

A streaming handler's span is made current only while the handler runs between two yields:
a stream abandoned mid-way (the client went away) then never detaches a context in another
task (which OpenTelemetry reports as an error).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from pdserve.errors import StatusError, abort_with

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
OnDone = Callable[[str, grpc.StatusCode], None]
_tracer = trace.get_tracer("pdserve")


def request_id_of(request: Any) -> str:
    """The request id a message carries (``meta.request_id``), or a fresh one for the log."""
    meta = getattr(request, "meta", None)
    rid = getattr(meta, "request_id", "") or getattr(request, "request_id", "")
    return str(rid) if rid else f"unnamed-{uuid.uuid4().hex[:12]}"



def _server_span(servicer: Any, rpc: str, context: grpc.aio.ServicerContext) -> trace.Span:
    service = getattr(servicer, "SERVICE", type(servicer).__name__.removesuffix("Servicer"))
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return _tracer.start_span(f"{service}.{rpc}", context=propagate.extract(carrier),
                              kind=trace.SpanKind.SERVER)


def status_error_of(exc: BaseException, rpc: str, request: Any) -> StatusError:
    """The status ``exc`` stands for: a StatusError is its own; anything else is logged with
    its traceback and becomes INTERNAL naming the request id (never the caller's fault). The
    gateway's in-process router answers with it too (``services.gateway.embedded``)."""
    if isinstance(exc, StatusError):
        return exc
    rid = request_id_of(request)
    log.error("rpc failed with an internal error", exc_info=exc,
              extra={"fields": {"rpc": rpc, "request_id": rid}})
    return StatusError(
        grpc.StatusCode.INTERNAL,
        f"{rpc}: internal error ({type(exc).__name__}) serving request {rid}; "
        "the service log has the details")


async def _answer(exc: BaseException, rpc: str, request: Any,
                  context: grpc.aio.ServicerContext) -> NoReturn:
    """Abort ``context`` with the status ``exc`` stands for."""
    await abort_with(context, status_error_of(exc, rpc, request))


@contextlib.asynccontextmanager
async def _idiom(rpc: str, request: Any, context: grpc.aio.ServicerContext,
                 on_done: OnDone | None, span: trace.Span) -> AsyncIterator[None]:
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
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            span.set_status(trace.StatusCode.ERROR, code.name)
        if on_done is not None:
            on_done(rpc, code)


def rpc_handler(rpc: str, on_done: OnDone | None = None) -> Callable[[F], F]:
    """Wrap a servicer method (unary or server-streaming) in the idiom of the module
    docstring."""

    def wrap(fn: F) -> F:
        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def stream(self: Any, request: Any,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                span = _server_span(self, rpc, context)
                current = trace.set_span_in_context(span)
                items: AsyncGenerator[Any, None] = fn(self, request, context)
                try:
                    async with _idiom(rpc, request, context, on_done, span):
                        while True:
                            token = otel_context.attach(current)
                            try:
                                item = await items.__anext__()
                            except StopAsyncIteration:
                                break
                            finally:
                                otel_context.detach(token)
                            yield item
                finally:
                    # A stream abandoned mid-way: the handler's own cleanup (its finally
                    # blocks: quota and admission slots, engine calls) runs now, in this
                    # task and context, not later from the garbage collector's.
                    await items.aclose()
                    span.end()

            return stream  # type: ignore[return-value]

        @functools.wraps(fn)
        async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            span = _server_span(self, rpc, context)
            with trace.use_span(span, end_on_exit=True):
                async with _idiom(rpc, request, context, on_done, span):
                    return await fn(self, request, context)
            raise AssertionError("unreachable: the idiom answers every failure by aborting")

        return unary  # type: ignore[return-value]

    return wrap
