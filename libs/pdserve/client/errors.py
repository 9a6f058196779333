"""Typed exceptions of the client: one class per status code the router answers, each keeping
the code, the message and the rich details (field violations, retry delay).

They are ``grpc.RpcError``s with the ``code()``/``details()``/``trailing_metadata()`` methods
of a failed gRPC call, so code written against plain gRPC stubs keeps working::

    try:
        text = client.generate("Hello", top_p=1.5).collect().text
    except InvalidArgument as err:
        print(err.field_violations[0].field)   # "sampling.top_p"
    except (ResourceExhausted, Unavailable) as err:
        time.sleep(err.retry_after or 1.0)
"""

from __future__ import annotations

from typing import Any

import grpc

from pdserve.errors import FieldViolation, details_of

__all__ = [
    "Aborted", "Cancelled", "DeadlineExceeded", "FailedPrecondition", "FieldViolation",
    "Internal", "InvalidArgument", "NotFound", "PdserveError", "PermissionDenied",
    "ResourceExhausted", "Unauthenticated", "Unavailable", "error_from",
]


class PdserveError(grpc.RpcError):
    """A call that ended with a non-OK status (the base of every class below)."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 field_violations: tuple[FieldViolation, ...] = (),
                 retry_after: float | None = None, trailing_metadata: Any = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.message = message
        self.field_violations = field_violations  # google.rpc.BadRequest
        self.retry_after = retry_after  # seconds, from google.rpc.RetryInfo
        self._code = code
        self._trailing_metadata = trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message

    def trailing_metadata(self) -> Any:
        return self._trailing_metadata


class InvalidArgument(PdserveError):
    """A request field is invalid; ``field_violations`` name it (``sampling.top_p``)."""


class NotFound(PdserveError):
    """The model is not served by this router."""


class ResourceExhausted(PdserveError):
    """A quota or the router's concurrency limit; try again after ``retry_after`` seconds."""


class Unavailable(PdserveError):
    """No capacity, or the router is unreachable (already retried by the channel's policy)."""


class DeadlineExceeded(PdserveError):
    """The call's deadline (``timeout``) passed; the router cancelled the work."""


class Cancelled(PdserveError):
    """The call was cancelled (the stream was closed, or the server went away)."""


class Unauthenticated(PdserveError):
    """Missing or wrong credentials."""


class PermissionDenied(PdserveError):
    """The credentials do not allow this call."""


class FailedPrecondition(PdserveError):
    """The server is not in a state to serve this call."""


class Aborted(PdserveError):
    """The request was aborted on the server."""


class Internal(PdserveError):
    """A server-side bug or broken dependency; the message names the request id to report."""


_BY_CODE: dict[grpc.StatusCode, type[PdserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.INTERNAL: Internal,
}


def error_from(exc: grpc.RpcError) -> PdserveError:
    """The typed exception of a failed call (sync ``grpc.RpcError`` or ``AioRpcError``)."""
    call: Any = exc
    code = call.code()
    details = details_of(call)
    cls = _BY_CODE.get(code, PdserveError)
    return cls(code, call.details() or code.name, details.violations, details.retry_after,
               call.trailing_metadata())
