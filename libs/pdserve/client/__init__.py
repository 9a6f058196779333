"""The Python client of the pdserve router (``pdserve.v1.Router`` over gRPC), blocking and
asyncio, with typed errors, deadlines, cancellation, gRPC retries and TLS::

    from pdserve.client import Client

    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("Hello", max_tokens=16, temperature=0):
            print(chunk.text, end="", flush=True)
        print(client.chat([{"role": "user", "content": "Hi"}]).collect().usage)

``AsyncClient`` is the same with ``async for`` / ``await``. docs/grpc.md has the whole story.
"""

from pdserve.client.aio import AsyncClient, AsyncGenerateStream
from pdserve.client.channel import TLS, Retry
from pdserve.client.errors import (
    Aborted,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    Internal,
    InvalidArgument,
    NotFound,
    PdserveError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from pdserve.client.request import GenerateParams
from pdserve.client.sync import Client, GenerateStream
from pdserve.client.types import Chunk, Completion, Model, Placement, PositionLogprobs, Usage

__all__ = [
    "TLS", "Aborted", "AsyncClient", "AsyncGenerateStream", "Cancelled", "Chunk", "Client",
    "Completion", "DeadlineExceeded", "FailedPrecondition", "FieldViolation", "GenerateParams",
    "GenerateStream", "Internal", "InvalidArgument", "Model", "NotFound", "PdserveError",
    "PermissionDenied", "Placement", "PositionLogprobs", "ResourceExhausted", "Retry",
    "Unauthenticated", "Unavailable", "Usage",
]
