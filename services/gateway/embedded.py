"""The router inside the gateway's process (``--router embedded``): ``RouterApi`` over the
router's own core (``services.router.core.Router``, built by the standalone router's
``build_router`` from the same flags), called directly: no gRPC hop, no protobuf
serialization of requests or answers. The standalone router stays for gRPC clients and for
deployments with several gateways; both run this one core.

The gateway cannot tell it from the gRPC router:

    answers   the core's messages, read with ``call.read()`` until ``grpc.aio.EOF``
    errors    any failure becomes the ``grpc.aio.AioRpcError`` the gRPC router answers: the
              servicers' own mapping (``pdserve.rpc.status_error_of``), its rich details in
              the trailing metadata, where ``pdserve.errors.details_of`` reads them
    deadline  every read is bounded by the call's deadline (DEADLINE_EXCEEDED), which is the
              core's ``time_remaining``
    cancel    ``call.cancel()``, or the reading task cancelled (the HTTP client went away),
              throws CancelledError into the core's generator (closes it when idle): its
              cleanup cancels the engine calls and aborts them, as a gRPC cancel does
    tracing   a ``Router.Generate`` span, child of the gateway's, current while the core runs

The core runs in the reading task itself (no task or queue per call): a message costs one
``__anext__``.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from pdserve.env import ConfigError
from pdserve.errors import StatusError
from pdserve.proto.v1 import router_pb2
from pdserve.rpc import status_error_of
from services.gateway.router_client import no_model
from services.router import metrics

Hook = Callable[[], Awaitable[None]]
_tracer = trace.get_tracer("pdserve")
_closing: set[asyncio.Task[None]] = set()  # generators being closed after a cancel


class RouterCore(Protocol):
    """The router functions the gRPC servicer calls too (``services.router.core.Router``)."""

    def generate(self, request: router_pb2.GenerateRequest,
                 time_remaining: Callable[[], float | None],
                 ) -> AsyncIterator[router_pb2.GenerateResponse]: ...

    def list_models(self) -> router_pb2.ListModelsResponse: ...

    def tokenize(self, request: router_pb2.TokenizeRequest) -> router_pb2.TokenizeResponse: ...

    def detokenize(self, request: router_pb2.DetokenizeRequest,
                   ) -> router_pb2.DetokenizeResponse: ...


def rpc_error(exc: StatusError) -> grpc.aio.AioRpcError:
    """The error a gRPC client of the router would get for ``exc``."""
    status = exc.to_status()
    return grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(),
                                grpc.aio.Metadata(*status.trailing_metadata), status.details)


def _count(code: grpc.StatusCode) -> None:
    metrics.REQUESTS.labels(code.name).inc()  # as the servicer's rpc_handler counts


class LocalCall:
    """One generation on the in-process core (``GenerateCall``)."""

    def __init__(self, core: RouterCore, request: router_pb2.GenerateRequest,
                 timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + timeout
        self._request = request
        self._span = _tracer.start_span("Router.Generate", kind=trace.SpanKind.INTERNAL)
        self._context = trace.set_span_in_context(self._span)
        self._messages = core.generate(request, self.time_remaining)
        self._reader: asyncio.Task[Any] | None = None  # the task inside read(), if any
        self._error: BaseException | None = None  # what every later read raises
        self._is_ended = False

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - self._loop.time())

    async def read(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._is_ended:
            return grpc.aio.EOF
        self._reader = asyncio.current_task()
        token = otel_context.attach(self._context)
        deadline = asyncio.timeout_at(self._deadline)
        try:
            async with deadline:
                return await anext(self._messages)
        except StopAsyncIteration:
            self._end(grpc.StatusCode.OK)
            return grpc.aio.EOF
        except asyncio.CancelledError:
            self._end(grpc.StatusCode.CANCELLED, asyncio.CancelledError())
            raise
        except TimeoutError as exc:
            failure = (StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                       if deadline.expired() else exc)
            raise self._fail(failure) from None
        except Exception as exc:  # noqa: BLE001 - mapped as the servicers map it
            raise self._fail(exc) from None
        finally:
            otel_context.detach(token)
            self._reader = None

    def cancel(self) -> bool:
        if self._is_ended:
            return False
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()  # its read ends the call
            return True
        self._end(grpc.StatusCode.CANCELLED, asyncio.CancelledError())
        task = self._loop.create_task(self._close())  # the core's cleanup, in its context
        _closing.add(task)
        task.add_done_callback(_closing.discard)
        return True

    async def _close(self) -> None:
        token = otel_context.attach(self._context)
        try:
            await self._messages.aclose()  # type: ignore[attr-defined]
        finally:
            otel_context.detach(token)

    def _fail(self, exc: BaseException) -> grpc.aio.AioRpcError:
        status = status_error_of(exc, "Generate", self._request)
        error = rpc_error(status)
        self._end(status.code, error)
        return error

    def _end(self, code: grpc.StatusCode, error: BaseException | None = None) -> None:
        if self._is_ended:
            return
        self._is_ended, self._error = True, error
        self._span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            self._span.set_status(trace.StatusCode.ERROR, code.name)
        self._span.end()
        _count(code)


class EmbeddedRouter:
    """``RouterApi`` over a router core in this process; ``start``/``close`` run the core's
    own lifecycle (instance polling, the controller) with the gateway's."""

    def __init__(self, core: RouterCore, timeout: float, starts: Sequence[Hook] = (),
                 stops: Sequence[Hook] = ()) -> None:
        self.core = core
        self.timeout = timeout
        self._starts, self._stops = list(starts), list(stops)
        self._is_serving = False
        self._default_model: str | None = None

    @classmethod
    def from_flags(cls, flags: str, timeout: float) -> EmbeddedRouter:
        """The router ``python -m services.router <flags>`` would run (its env twins too)."""
        from services.router.__main__ import build_router, lifecycle
        from services.router.config import RouterConfig

        try:
            config = RouterConfig.from_argv(shlex.split(flags))
        except ConfigError as exc:  # a cross-field check: say where the flags came from
            raise ConfigError(f"--router-flags: {exc}") from None
        router = build_router(config)
        starts, stops = lifecycle(router)
        return cls(router, timeout, starts, stops)

    async def start(self) -> None:
        for hook in self._starts:
            await hook()
        self._is_serving = True

    async def close(self) -> None:
        self._is_serving = False
        for hook in self._stops:
            await hook()

    def generate(self, request: router_pb2.GenerateRequest,
                 metadata: tuple[tuple[str, str], ...] = (),
                 timeout: float | None = None) -> LocalCall:
        """``metadata`` is not needed: the trace context is this task's, and no credential
        is checked inside one process."""
        return LocalCall(self.core, request, timeout or self.timeout)

    async def list_models(self, timeout: float = 5.0) -> list[router_pb2.ModelInfo]:
        return list(self._unary("ListModels", None, self.core.list_models).models)

    async def tokenize(self, request: router_pb2.TokenizeRequest,
                       metadata: tuple[tuple[str, str], ...] = ()
                       ) -> router_pb2.TokenizeResponse:
        return self._unary("Tokenize", request, lambda: self.core.tokenize(request))

    async def detokenize(self, request: router_pb2.DetokenizeRequest,
                         metadata: tuple[tuple[str, str], ...] = (),
                         ) -> router_pb2.DetokenizeResponse:
        return self._unary("Detokenize", request, lambda: self.core.detokenize(request))

    async def default_model(self) -> str:
        """The core's first model (its names are fixed while it runs)."""
        if self._default_model is None:
            models = await self.list_models()
            if not models:
                raise no_model()
            self._default_model = models[0].id
        return self._default_model

    async def check(self, timeout: float = 2.0) -> bool:
        """Serving from ``start`` to ``close``, as the standalone router's health check."""
        return self._is_serving

    @staticmethod
    def _unary(rpc: str, request: Any, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - mapped as the servicers map it
            raise rpc_error(status_error_of(exc, rpc, request)) from None
