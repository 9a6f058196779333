"""The FastAPI application: routes, the OpenAPI document, and a fast path for generation.

The handlers themselves live in ``servicer.Gateway``; this module only wires them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import ApiError
from services.gateway.schema import ChatCompletionRequest, CompletionRequest
from services.gateway.servicer import Api, Gateway, error_response


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

    @app.get("/v1/models/{model_id}", summary="One served model (404 if not served)")
    async def model(request: Request, model_id: str) -> Response:
        return await gw.models(request, model_id)

    @app.post("/tokenize", summary="Token ids of a prompt or a chat, as generation would make "
              "them (vLLM's shape: count, max_model_len, tokens)")
    async def tokenize(request: Request) -> Response:
        return await gw.tokens(request, detokenize=False)

    @app.post("/detokenize", summary="Text of token ids (vLLM's shape: prompt)")
    async def detokenize(request: Request) -> Response:
        return await gw.tokens(request, detokenize=True)

    @app.get("/health", summary="Liveness: 200 when the router answers its health check, else "
             "503 (open without an API key; names no address)")
    async def health() -> Response:
        return await gw.health()

    @app.get("/metrics", summary="Prometheus metrics (needs an API key when keys are on)")
    async def metrics() -> Response:
        return Response(gw.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Unknown paths and methods, in OpenAI's error shape too.
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
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
               404: "unknown model", 408: "headers or body too slow to arrive",
               413: "body too large",
               429: "tenant quota exceeded, admission queue full, or the deadline cannot be "
                    "met (see Retry-After)", 503: "no capacity",
               504: "deadline exceeded (X-Request-Timeout or the server's limit)"}


def _body_doc(model: type[Api]) -> dict[str, Any]:
    # The body is parsed by hand (pydantic straight from bytes, errors in OpenAI's shape), so
    # the OpenAPI document names its schema explicitly.
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


# Paths that answer only with a valid API key when keys are on (FastAPI's docs included).
PROTECTED = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class FastPath:
    """POST /v1/completions and /v1/chat/completions straight from ASGI to the handler,
    around FastAPI's middleware, routing and dependency solving (a measurable share of the
    gateway's added latency). The same handlers are FastAPI routes too, which document them in
    the OpenAPI schema; every other path goes to FastAPI."""

    def __init__(self, app: ASGIApp, gw: Gateway) -> None:
        self.app = app
        self.gw = gw
        self.routes: dict[str, tuple[str, type[Api]]] = {
            "/v1/completions": ("completions", CompletionRequest),
            "/v1/chat/completions": ("chat", ChatCompletionRequest),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if scope["type"] == "http" and scope["path"] in PROTECTED:
            try:  # with API keys on, only /health (and the API itself, by key) is open
                self.gw.keys.tenant(Request(scope, receive).headers.get("authorization"))
            except ApiError as exc:
                await error_response(exc)(scope, receive, send)
                return
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        response = await self.gw.handle(Request(scope, receive), *route)
        await response(scope, receive, send)
