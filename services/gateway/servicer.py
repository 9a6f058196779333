"""The gateway servicer: OpenAI REST requests over the router's gRPC ``Generate`` stream.

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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import Request, Response
from opentelemetry import propagate, trace
from pydantic import ValidationError

from pdserve.log import fields
from pdserve.proto.v1 import router_pb2
from pdserve.telemetry import outbound_metadata
from services.gateway import responses as shapes
from services.gateway.auth import CacheSalter, KeyStore
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError, bad_request, from_rpc_error, from_validation
from services.gateway.generate import ChoiceOutput, Generation, collect
from services.gateway.limits import HEARTBEAT, read_body, request_timeout, with_heartbeats
from services.gateway.metrics import GatewayMetrics
from services.gateway.router_client import RouterApi
from services.gateway.schema import ChatCompletionRequest, CompletionRequest
from services.gateway.sse import SSE_HEADERS, ClientGone, SSEResponse, cancel_on_disconnect
from services.gateway.tokens import DetokenizeRequest, TokenizeRequest, tokenize_body

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("pdserve.gateway")
Api = CompletionRequest | ChatCompletionRequest
_STATUS_499 = 499  # nginx's "client closed request": nobody reads it, metrics do


class _StreamEnd:
    """Runs once however a stream ends, even one whose body never started (a client gone before
    the first byte): cancels the router calls and records the request."""

    def __init__(self, gw: Gateway, gen: Generation, endpoint: str, start: float,
                 span: trace.Span) -> None:
        self.gw, self.gen, self.endpoint, self.start, self.span = gw, gen, endpoint, start, span
        self.status = _STATUS_499  # until the stream says otherwise
        self.ended = False

    def __call__(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.gen.cancel()
        if self.status == _STATUS_499:
            self.gw.metrics.disconnects.inc()
        self.gw._record(self.endpoint, self.status, self.start, self.span)


@dataclass
class Gateway:
    config: GatewayConfig
    client: RouterApi
    keys: KeyStore
    metrics: GatewayMetrics
    salter: CacheSalter

    async def handle(self, request: Request, endpoint: str, model_cls: type[Api]) -> Response:
        start = time.perf_counter()
        self.metrics.in_flight.inc()
        # A server span continuing the client's W3C traceparent; its context rides on the
        # router calls' metadata. A stream's span ends with the stream.
        span = _tracer.start_span(f"POST {request.scope['path']}", kind=trace.SpanKind.SERVER,
                                  context=propagate.extract(request.headers))
        try:
            with trace.use_span(span, end_on_exit=False):
                response = await self._respond(request, model_cls, start)
        except ClientGone:
            self.metrics.disconnects.inc()
            response = Response(status_code=_STATUS_499)
        except BaseException:
            self._record(endpoint, 500, start, span)
            raise
        if not isinstance(response, SSEResponse):  # a stream records itself when it ends
            self._record(endpoint, response.status_code, start, span)
        return response

    async def _respond(self, request: Request, model_cls: type[Api], start: float
                       ) -> Response:
        try:
            tenant = self.keys.tenant(request.headers.get("authorization"))
            req = model_cls.model_validate_json(await self._body(request))
            return await self._generate(request, req, tenant, start)
        except ValidationError as exc:
            err = from_validation(exc)
        except ApiError as exc:
            err = exc
        except grpc.aio.AioRpcError as exc:
            err = self._rpc_error(exc)
        if err.status >= 500:
            log.warning("request failed", extra=fields(status=err.status, error=err.message))
        return error_response(err)

    async def _generate(self, request: Request, req: Api, tenant: str, start: float
                        ) -> Response:
        inputs = req.inputs()
        num_choices = len(inputs) * req.n
        if num_choices > self.config.max_choices:
            raise bad_request(f"n: {req.n} choices x {len(inputs)} prompts exceeds the limit of "
                              f"{self.config.max_choices}", "n")
        chat = isinstance(req, ChatCompletionRequest)
        rid = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
        model = await self._router_model(req.model)
        shown = req.model or await self.client.default_model()  # the response's "model"
        trace.get_current_span().set_attribute("pdserve.request_id", rid)
        if not self.keys.enabled:
            tenant = req.user or ""  # no keys: the caller says who it is (no isolation)
        salt = self.salter.salt(self.keys.cache_identity(tenant), req.cache_salt)
        timeout = request_timeout(request.headers, self.config.request_timeout)
        gen = Generation(self.client, outbound_metadata(), req.router_requests(
            model, inputs, req.completion_limit, req.num_logprobs, rid, tenant, salt), start,
            timeout)
        created = int(time.time())
        logprobs = req.num_logprobs is not None
        starting: asyncio.Future[None] | None = None
        try:
            with cancel_on_disconnect(request.receive):
                try:
                    if req.stream:  # see _start_stream
                        starting = await self._start_stream(gen)
                    else:
                        await gen.start()
                except grpc.aio.AioRpcError as exc:
                    raise self._rpc_error(exc, False, timeout) from exc
                if not req.stream:
                    try:
                        choices = await collect(gen, num_choices, req.calls_finish)
                    except grpc.aio.AioRpcError as exc:
                        raise self._rpc_error(exc, True, timeout) from exc
            if req.stream:
                writer = shapes.ChunkWriter(rid, created, shown, chat, req.include_usage,
                                            logprobs)
                end = _StreamEnd(self, gen, "chat" if chat else "completions", start,
                                 trace.get_current_span())
                choices = [ChoiceOutput(req.calls_finish) for _ in range(num_choices)]
                body = self._stream(gen, writer, choices, req.n, req.include_usage, end,
                                    starting, req.continuous_usage)
                return SSEResponse(body, end, {**SSE_HEADERS, "x-request-id": rid})
        except BaseException:
            if starting is not None:
                starting.cancel()
            gen.cancel()
            raise
        gen.cancel()
        self._account(gen, choices, req.n, "chat" if chat else "completions")
        build = shapes.chat_body if chat else shapes.completion_body
        return Response(shapes.dumps(build(rid, created, shown, choices, req.n, logprobs)),
                        media_type="application/json", headers={"x-request-id": rid})

    async def _start_stream(self, gen: Generation) -> asyncio.Future[None] | None:
        """Wait up to one heartbeat for the stream's first messages: an error known by then
        keeps its HTTP status (a 429 with Retry-After, a 400). A request still waiting (queued
        for capacity) is answered 200 at once and keeps the connection alive with SSE
        comments meanwhile: the returned start, which ``_stream`` awaits."""
        starting = asyncio.ensure_future(gen.start())
        await asyncio.wait((starting,), timeout=self.config.sse_heartbeat)
        if not starting.done():
            return starting
        starting.result()
        return None

    async def _stream(self, gen: Generation, writer: shapes.ChunkWriter,
                      choices: list[ChoiceOutput], n: int, include_usage: bool, end: _StreamEnd,
                      starting: asyncio.Future[None] | None = None,
                      continuous_usage: bool = False) -> AsyncIterator[bytes]:
        num_choices = len(choices)
        # Final chunks wait for the end of the stream so that they, the usage and [DONE] leave
        # in one write: fewer sends per request on the hot path.
        tail: list[bytes] = []
        try:
            if starting is not None:
                async for _ in with_heartbeats(_until(starting), self.config.sse_heartbeat):
                    yield HEARTBEAT
                try:
                    starting.result()
                except grpc.aio.AioRpcError as exc:
                    raise self._rpc_error(exc, False, gen.timeout) from exc
            if writer.chat:
                yield b"".join(writer.role(i) for i in range(num_choices))
            async for item in with_heartbeats(gen.messages(), self.config.sse_heartbeat):
                if item is None:  # silence: tell the client the stream is alive
                    yield HEARTBEAT
                    continue
                i, msg = item
                choices[i].add(msg, 0)
                chunk = writer.chunk(i, msg, choices[i].finish,
                                     shapes.usage_of(choices, n) if continuous_usage else None)
                if chunk is not None and choices[i].finish is None:
                    yield chunk
                elif chunk is not None:
                    tail.append(chunk)
            if any(c.finish is None for c in choices):
                raise ApiError(502, "the router's stream ended without a finish reason",
                               "server_error", code="incomplete")
            if include_usage:
                tail.append(writer.usage(choices, n))
            end.status = 200
            self._account(gen, choices, n, end.endpoint)
        except ApiError as exc:
            end.status = exc.status
            tail.append(shapes.sse_error(exc))
        except grpc.aio.AioRpcError as exc:
            err = self._rpc_error(exc, True, gen.timeout)
            end.status = err.status
            tail.append(shapes.sse_error(err))
        except Exception:
            end.status = 500
            raise
        finally:
            if starting is not None and not starting.done():
                starting.cancel()
            end()
        tail.append(shapes.DONE)
        yield b"".join(tail)

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes, self.config.body_timeout)

    async def _router_model(self, name: str | None) -> str:
        """``--model-name`` is an alias of the router's model; other names go through as is;
        none means the router's model (empty)."""
        if self.config.model_name and name == self.config.model_name:
            return await self.client.default_model()
        return name or ""

    def _rpc_error(self, exc: grpc.aio.AioRpcError, started: bool = False,
                   timeout: float | None = None) -> ApiError:
        self.metrics.router_errors.labels(exc.code().name).inc()
        return from_rpc_error(exc, started, timeout)

    def _account(self, gen: Generation, choices: list[ChoiceOutput], n: int, endpoint: str) -> None:
        usage: dict[str, Any] = shapes.usage_of(choices, n)
        self.metrics.count_tokens(usage["prompt_tokens"], usage["completion_tokens"])
        if gen.ttft is not None:
            self.metrics.observe_ttft(endpoint, gen.ttft)

    def _record(self, endpoint: str, status: int, start: float, span: trace.Span) -> None:
        span.set_attribute("http.response.status_code", status)
        span.end()
        self.metrics.record(endpoint, status, time.perf_counter() - start)

    async def models(self, request: Request, model_id: str | None = None) -> Response:
        """``/v1/models``, or one model (404 when not served) for ``/v1/models/{model_id}``."""
        try:
            self.keys.tenant(request.headers.get("authorization"))
            infos = await self.client.list_models()
        except ApiError as exc:
            return error_response(exc)
        except grpc.aio.AioRpcError as exc:
            return error_response(self._rpc_error(exc))
        data = [{"id": (self.config.model_name if i == 0 and self.config.model_name else m.id),
                 "object": "model", "created": 0, "owned_by": "pdserve",
                 "root": m.root or m.id, "parent": None, "max_model_len": m.max_context}
                for i, m in enumerate(infos)]
        if model_id is None:
            return Response(shapes.dumps({"object": "list", "data": data}),
                            media_type="application/json")
        found = next((m for m in data if m["id"] == model_id), None)
        if found is None:
            return error_response(ApiError(404, f"model: {model_id!r} is not served", param="model",
                                           code="model_not_found"))
        return Response(shapes.dumps(found), media_type="application/json")

    async def tokens(self, request: Request, detokenize: bool) -> Response:
        """``/tokenize`` or ``/detokenize`` through the router."""
        try:
            self.keys.tenant(request.headers.get("authorization"))
            body = await self._body(request)
            if detokenize:
                dreq = DetokenizeRequest.model_validate_json(body)
                reply = await self.client.detokenize(router_pb2.DetokenizeRequest(
                    model=await self._router_model(dreq.model), token_ids=dreq.tokens),
                    outbound_metadata())
                out: dict[str, Any] = {"prompt": reply.text}
            else:
                treq = TokenizeRequest.model_validate_json(body)
                out = tokenize_body(await self.client.tokenize(
                    treq.to_proto(await self._router_model(treq.model)), outbound_metadata()))
        except ValidationError as exc:
            return error_response(from_validation(exc))
        except ApiError as exc:
            return error_response(exc)
        except grpc.aio.AioRpcError as exc:
            return error_response(self._rpc_error(exc))
        return Response(shapes.dumps(out), media_type="application/json")

    async def health(self) -> Response:
        """Liveness: open without a key, so it names no address."""
        ok = await self.client.check()
        body = {"status": "ok" if ok else "unavailable", "router_serving": ok}
        return Response(shapes.dumps(body), status_code=200 if ok else 503,
                        media_type="application/json")


async def _until(future: asyncio.Future[None]) -> AsyncIterator[None]:
    """Nothing, once ``future`` is done (its outcome is read by the caller)."""
    await asyncio.wait((future,))
    return
    yield  # an async generator


def error_response(err: ApiError) -> Response:
    return Response(err.json_bytes(), status_code=err.status, media_type="application/json",
                    headers=err.headers)
