"""One exception type for every kvd failure a caller must see, carrying its gRPC status code."""

from __future__ import annotations

import grpc


class KvdError(Exception):
    """A failure with the status code the servicer answers with and a message naming the field."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> KvdError:
    return KvdError(grpc.StatusCode.INVALID_ARGUMENT, message)
