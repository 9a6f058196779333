"""The HTTP face of pdserve: OpenAI's REST API over the router's gRPC ``Generate`` stream.

A request: auth (Bearer key -> tenant) -> body (size-limited) -> pydantic validation -> one
router call per choice -> first messages awaited (so early errors keep their HTTP status) ->
a JSON answer, or SSE chunks ending in ``data: [DONE]``. A client that disconnects cancels its
router calls; a router error after the stream started becomes an SSE error event.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import StreamingResponse
from pdserve.log import fields
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from services.gateway import responses as shapes
from services.gateway.auth import KeyStore
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError, bad_request, from_rpc_error, from_validation
from services.gateway.generate import Choice, Generation, collect
from services.gateway.metrics import GatewayMetrics
from services.gateway.router_client import RouterClient
from services.gateway.schema import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)
T = TypeVar("T")
Api = CompletionRequest | ChatCompletionRequest
_STATUS_499 = 499  # nginx's "client closed request": nobody reads it, metrics do


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class _SSEResponse(StreamingResponse):
    """Closes its generator however the response ends, so the router calls are cancelled."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


@dataclass
class Gateway:
    config: GatewayConfig
    client: RouterClient
    keys: KeyStore
    metrics: GatewayMetrics

    async def handle(self, request: Request, endpoint: str, model_cls: type[Api]) -> Response:
        start = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            response = await self._respond(request, model_cls)
        except ClientGone:
            self.metrics.disconnects.inc()
            response = Response(status_code=_STATUS_499)
        except BaseException:
            self._record(endpoint, 500, start)
            raise
        if not isinstance(response, _SSEResponse):  # a stream records itself when it ends
            self._record(endpoint, response.status_code, start)
        return response

    async def _respond(self, request: Request, model_cls: type[Api]) -> Response:
        try:
            tenant = self.keys.tenant(request.headers.get("authorization"))
            req = model_cls.model_validate_json(await self._body(request))
            return await self._generate(request, req, tenant)
        except ValidationError as exc:
            err = from_validation(exc)
        except ApiError as exc:
            err = exc
        except grpc.aio.AioRpcError as exc:
            err = self._rpc_error(exc)
        if err.status >= 500:
            log.warning("request failed", extra=fields(status=err.status, error=err.message))
        return _error_response(err)

    async def _generate(self, request: Request, req: Api, tenant: str) -> Response:
        inputs = req.inputs()
        num_choices = len(inputs) * req.n
        if num_choices > self.config.max_choices:
            raise bad_request(f"n: {req.n} choices x {len(inputs)} prompts exceeds the limit of "
                              f"{self.config.max_choices}", "n")
        chat = isinstance(req, ChatCompletionRequest)
        rid = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
        model = await self._router_model(req.model)
        gen = Generation(self.client, req.router_requests(
            model, inputs, req.completion_limit, req.num_logprobs, rid,
            tenant if self.keys.enabled else (req.user or "")))
        created = int(time.time())
        logprobs = req.num_logprobs is not None
        try:
            await _unless_disconnected(request, gen.start())
            if req.stream:
                writer = shapes.ChunkWriter(rid, created, req.model, chat, req.include_usage,
                                            logprobs)
                body = self._stream(gen, writer, num_choices, req.n, req.include_usage)
                return _SSEResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)
            choices = await _unless_disconnected(request, collect(gen, num_choices))
        except BaseException:
            gen.cancel()
            raise
        gen.cancel()
        self._account(gen, choices, req.n, "chat" if chat else "completions")
        build = shapes.chat_body if chat else shapes.completion_body
        return Response(shapes.dumps(build(rid, created, req.model, choices, req.n, logprobs)),
                        media_type="application/json", headers={"x-request-id": rid})

    async def _stream(self, gen: Generation, writer: shapes.ChunkWriter, num_choices: int, n: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
        endpoint = "chat" if writer.chat else "completions"
        status, choices = 500, [Choice() for _ in range(num_choices)]
        try:
            if writer.chat:
                for i in range(num_choices):
                    yield writer.role(i)
            async for i, msg in gen.messages():
                choices[i].add(msg, 0)
                chunk = writer.chunk(i, msg, choices[i].finish)
                if chunk is not None:
                    yield chunk
            if any(c.finish is None for c in choices):
                raise ApiError(502, "the router's stream ended without a finish reason",
                               "server_error", code="incomplete")
            if include_usage:
                yield writer.usage(choices, n)
            status = 200
            self._account(gen, choices, n, endpoint)
        except ApiError as exc:
            status = exc.status
            yield shapes.sse_error(exc)
        except grpc.aio.AioRpcError as exc:
            err = self._rpc_error(exc)
            status = err.status
            yield shapes.sse_error(err)
        except (asyncio.CancelledError, GeneratorExit):
            status = _STATUS_499
            self.metrics.disconnects.inc()
            raise
        finally:
            gen.cancel()
            self._record(endpoint, status, gen.start_time)
        yield shapes.DONE

    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body: larger than {limit} bytes", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body: larger than {limit} bytes",
                               code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _router_model(self, name: str) -> str:
        """``--model-name`` is an alias of the router's model; other names go through as is."""
        if self.config.model_name and name == self.config.model_name:
            return await self.client.default_model()
        return name

    def _rpc_error(self, exc: grpc.aio.AioRpcError) -> ApiError:
        self.metrics.router_errors.labels(exc.code().name).inc()
        return from_rpc_error(exc)

    def _account(self, gen: Generation, choices: list[Choice], n: int, endpoint: str) -> None:
        usage: dict[str, Any] = shapes.usage_of(choices, n)
        self.metrics.count_tokens(usage["prompt_tokens"], usage["completion_tokens"])
        if gen.ttft is not None:
            self.metrics.ttft.labels(endpoint).observe(gen.ttft)

    def _record(self, endpoint: str, status: int, start: float) -> None:
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    async def models(self, request: Request) -> Response:
        try:
            self.keys.tenant(request.headers.get("authorization"))
            infos = await self.client.list_models()
        except ApiError as exc:
            return _error_response(exc)
        except grpc.aio.AioRpcError as exc:
            return _error_response(self._rpc_error(exc))
        data = [{"id": (self.config.model_name if i == 0 and self.config.model_name else m.id),
                 "object": "model", "created": 0, "owned_by": "pdserve",
                 "max_model_len": m.max_context} for i, m in enumerate(infos)]
        return Response(shapes.dumps({"object": "list", "data": data}),
                        media_type="application/json")

    async def health(self) -> Response:
        ok = await self.client.check()
        body = {"status": "ok" if ok else "unavailable", "router": self.client.address,
                "router_serving": ok}
        return Response(shapes.dumps(body), status_code=200 if ok else 503,
                        media_type="application/json")


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error_response(err: ApiError) -> Response:
    return Response(err.json_bytes(), status_code=err.status, media_type="application/json",
                    headers=err.headers)


async def _until_disconnected(request: Request) -> None:
    # After the body is read, the next ASGI message is the disconnect (or nothing).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone()


def create_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="pdserve gateway", version="1",
                  description="OpenAI-compatible HTTP API of pdserve (speaks gRPC to the router)")
    errors: dict[int | str, dict[str, Any]] = {
        code: {"description": text} for code, text in _ERROR_DOCS.items()}

    @app.post("/v1/completions", openapi_extra=_body_doc(CompletionRequest), responses=errors,
              summary="Text completion (SSE chunks when stream is true)")
    async def completions(request: Request) -> Response:
        return await gw.handle(request, "completions", CompletionRequest)

    @app.post("/v1/chat/completions", openapi_extra=_body_doc(ChatCompletionRequest),
              responses=errors, summary="Chat completion (SSE chunks when stream is true)")
    async def chat_completions(request: Request) -> Response:
        return await gw.handle(request, "chat", ChatCompletionRequest)

    @app.get("/v1/models", summary="Models served")
    async def models(request: Request) -> Response:
        return await gw.models(request)

    @app.get("/health", summary="200 when the router answers its health check, else 503")
    async def health() -> Response:
        return await gw.health()

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Unknown paths and methods, in OpenAI's error shape too.
        return _error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                        f"{exc.detail}", code=str(exc.status_code)))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


_ERROR_DOCS = {400: "bad parameter (error.param names it)", 401: "missing or invalid API key",
               404: "unknown model", 413: "body too large",
               429: "tenant quota exceeded (see Retry-After)", 503: "no capacity",
               504: "deadline exceeded"}


def _body_doc(model: type[Api]) -> dict[str, Any]:
    # The body is parsed by hand (pydantic straight from bytes, errors in OpenAI's shape), so
    # the OpenAPI document names its schema explicitly.
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
