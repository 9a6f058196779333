"""OpenAI's error JSON, and where each error comes from: validation, auth, or a router status
(read from its rich details, as every gRPC client of pdserve reads them).

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status a client's retry logic
expects: 400 bad params (``param`` names the field), 401 key, 404 model, 429 quota (with
``Retry-After``), 503 no capacity, 504 deadline.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import grpc
from pydantic import ValidationError

from pdserve.errors import details_of
from services.gateway.schema import FieldError

# gRPC status -> (HTTP status, OpenAI error type, code).
_FROM_GRPC: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "no_capacity"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "server_error", "cancelled"),
}

# Per-field hints for union-typed fields, whose raw pydantic messages name an arbitrary branch.
_UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


@dataclass
class ApiError(Exception):
    """An error answered to the client in OpenAI's shape."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.message}"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "authentication_error", code="invalid_api_key")


def from_rpc_error(exc: grpc.aio.AioRpcError, started: bool = False,
                   timeout: float | None = None) -> ApiError:
    """Map a router status to HTTP, from its rich details (``pdserve.errors.details_of``):
    the first field violation is ``param`` (in OpenAI's names), RetryInfo is Retry-After.
    ``started``: the answer had begun (a failure then is not a lack of capacity);
    ``timeout``: the request's deadline, named in a deadline error."""
    code = exc.code()
    status, kind, err_code = _FROM_GRPC.get(code, (500, "server_error", "internal_error"))
    message = exc.details() or code.name
    if started and code == grpc.StatusCode.UNAVAILABLE:
        err_code = "stream_interrupted"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
        message = (f"request timed out after {timeout:g}s (X-Request-Timeout, at most "
                   f"--request-timeout): {message}")
    details = details_of(exc)
    param = None
    if status == 400 and details.violations:
        param = openai_param(details.violations[0].field)
    elif status == 404:
        param = "model"
    headers = {}
    if details.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(details.retry_after)))
    return ApiError(status, message, kind, param, err_code, headers)


# The router names contract fields; clients know OpenAI's names.
_RENAMES = (("sampling.structured.json_schema", "response_format"),
            ("sampling.structured.json_object", "response_format"),
            ("sampling.structured.regex", "guided_regex"),
            ("sampling.structured.choice", "guided_choice"),
            ("sampling.structured.grammar", "guided_grammar"),
            ("sampling.", ""), ("chat.messages", "messages"), ("chat.documents", "documents"),
            ("prompt_token_ids", "prompt"), ("meta.", ""))


def openai_param(field: str) -> str | None:
    """A router request field ("sampling.top_p") in OpenAI's terms ("top_p")."""
    for prefix, replacement in _RENAMES:
        if field.startswith(prefix):
            field = replacement + field[len(prefix):]
            if replacement in ("response_format", "guided_choice"):  # one field here
                field = replacement
    return field or None


def from_validation(exc: ValidationError) -> ApiError:
    """The first problem, with ``param`` in OpenAI's spelling (``messages[0].content``)."""
    errors = exc.errors()
    err = errors[0]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, FieldError):
        return bad_request(str(cause), cause.param)
    if err["type"] == "json_invalid":
        return bad_request(f"request body is not valid JSON: {err['msg']}")
    raw_loc = err["loc"]
    loc = [p for p in raw_loc if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS)]
    if not loc:
        return bad_request(f"request body: {err['msg']}")
    param = format_loc(loc)
    message = _describe(err)
    if len(loc) < len(raw_loc) and err["type"] != "value_error":
        # A union type whose every branch failed: say what is accepted instead.
        field_loc = loc[: next(i for i, p in enumerate(raw_loc) if p not in loc)]
        param = format_loc(field_loc)
        last = next((p for p in reversed(field_loc) if isinstance(p, str)), "")
        message = f"must be {_UNION_HINTS.get(last, 'of an accepted type')}"
    return bad_request(f"{param}: {message}", param)


_BOUNDS = {"greater_than_equal": ("ge", ">="), "less_than_equal": ("le", "<="),
           "greater_than": ("gt", ">"), "less_than": ("lt", "<")}


def _describe(err: Any) -> str:
    """A short message in the API's terms ("must be >= 0, got -1"), else pydantic's own."""
    kind, ctx = err["type"], err.get("ctx", {})
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        return f"must be {op} {ctx[key]}, got {err['input']!r}"
    if kind == "missing":
        return "is required"
    if kind == "too_short":
        return f"must have at least {ctx.get('min_length', 1)} item(s)"
    if kind == "string_too_short":
        return "must not be empty"
    return str(err["msg"]).removeprefix("Value error, ")


def format_loc(loc: list[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out
