"""The one error idiom of every pdserve gRPC service, and the rich status details it sends.

Code that finds a problem raises ``StatusError`` (or ``BadRequest``, its INVALID_ARGUMENT
form, whose message starts with the offending field); each rpc handler is wrapped in
``@rpc_handler(...)`` (``pdserve.rpc``), which answers a StatusError with its code, its message
and a ``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer (grpcio-status) carrying:

    INVALID_ARGUMENT                 google.rpc.BadRequest: one field violation per bad field
                                     (``sampling.top_p``: the field's path in the request)
    RESOURCE_EXHAUSTED, UNAVAILABLE  google.rpc.RetryInfo: when to try again (``retry_after``,
                                     else DEFAULT_RETRY_AFTER), also as the
                                     ``grpc-retry-pushback-ms`` trailer that gRPC's retry
                                     policy obeys; an explicit ``retry_after`` also goes out as
                                     the ``retry-after`` trailer (whole seconds)

Anything else is a bug or a broken dependency, never the caller's fault: it is logged with its
traceback and the request id, and answered INTERNAL naming that id.

The other side reads the same details with ``details_of(rpc_error)``: the Python client
(``pdserve.client``), the gateway's OpenAI errors and the router relaying an engine's status.
"""

from __future__ import annotations

import datetime
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

log = logging.getLogger(__name__)

RETRY_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
DEFAULT_RETRY_AFTER = 1.0  # seconds: about one router poll of instance health
RETRY_AFTER_KEY = "retry-after"
PUSHBACK_KEY = "grpc-retry-pushback-ms"
# A message names its field first: "sampling.top_p must be ...", "chat.messages[1].role: ...".
_LEADING_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*)(?::\s*|\s+|$)")


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request (``google.rpc.BadRequest.FieldViolation``)."""

    field: str  # its path in the request message: "sampling.top_p", "chat.messages[0].role"
    description: str


def field_of(message: str) -> str | None:
    """The field a BadRequest message starts with, or None."""
    match = _LEADING_FIELD.match(message)
    return match.group(1) if match else None


class StatusError(Exception):
    """A failure the caller must see as ``code``. ``retry_after`` seconds, when given, go out
    as RetryInfo and the ``retry-after`` trailer; ``violations`` as a google.rpc.BadRequest."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None,
                 violations: Sequence[FieldViolation] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.violations = tuple(violations)

    @classmethod
    def relay(cls, error: grpc.RpcError, where: str) -> StatusError:
        """``error`` from a peer, passed on with its code and details, ``where`` prefixed."""
        call: Any = error
        details = details_of(call)
        return cls(call.code(), f"{where}: {call.details() or call.code().name}",
                   details.retry_after, details.violations)

    def to_status(self) -> grpc.Status:
        """The status to answer with: code, message, and the details in trailing metadata."""
        details = []
        if self.violations:
            details.append(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field,
                                                            description=v.description)
                for v in self.violations]))
        trailers: list[tuple[str, str]] = []
        if self.retry_after is not None or self.code in RETRY_CODES:
            retry = error_details_pb2.RetryInfo()
            delay = DEFAULT_RETRY_AFTER if self.retry_after is None else self.retry_after
            retry.retry_delay.FromTimedelta(datetime.timedelta(seconds=max(0.0, delay)))
            details.append(retry)
            # gRPC's own retry policy waits this long instead of its backoff (gRFC A6).
            trailers.append((PUSHBACK_KEY, str(int(max(0.0, delay) * 1000))))
        if self.retry_after is not None:
            trailers.append((RETRY_AFTER_KEY, str(max(1, math.ceil(self.retry_after)))))
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        for detail in details:
            status.details.add().Pack(detail)
        out = rpc_status.to_status(status)
        return _Status(out.code, out.details, (*out.trailing_metadata, *trailers))


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


class BadRequest(StatusError, ValueError):
    """The caller's request is invalid; the message names the field (``sampling.top_p ...``),
    which becomes the field violation (``field`` overrides it). A ValueError too, so offline
    callers of the engine catch it as one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        name = field or field_of(message) or ""
        description = message
        if name and message.startswith(name):
            description = message[len(name):].lstrip(": ") or message
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message,
                         violations=[FieldViolation(name, description)])
        self.field = name


class _CallLike(Protocol):
    def code(self) -> grpc.StatusCode: ...
    def details(self) -> str | None: ...
    def trailing_metadata(self) -> Any: ...


@dataclass(frozen=True)
class StatusDetails:
    """What a failed call's ``google.rpc.Status`` says beyond code and message."""

    violations: tuple[FieldViolation, ...] = ()
    retry_after: float | None = None  # seconds


def details_of(call: _CallLike) -> StatusDetails:
    """The rich details of a failed call (``grpc.RpcError`` sync or aio); empty when it has
    none (a status from a proxy or from gRPC itself, such as DEADLINE_EXCEEDED)."""
    try:
        status = rpc_status.from_call(call)
    except ValueError:  # code or message rewritten on the way: the details are not its own
        status = None
    if status is None:
        return StatusDetails()
    violations: list[FieldViolation] = []
    retry_after = None
    for any_detail in status.details:
        if any_detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            any_detail.Unpack(bad)
            violations += [FieldViolation(v.field, v.description) for v in bad.field_violations]
        elif any_detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            any_detail.Unpack(info)
            retry_after = info.retry_delay.ToTimedelta().total_seconds()
    return StatusDetails(tuple(violations), retry_after)


async def abort_with(context: grpc.aio.ServicerContext, exc: StatusError) -> NoReturn:
    """End the call with ``exc``'s status, details included."""
    status = exc.to_status()
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("unreachable: context.abort raises")
