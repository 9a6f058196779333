"""What every pdserve gRPC endpoint agrees on: message limits; and the channels pdserve's own
processes open, presenting the caller's credentials (``pdserve.auth``) on every call."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from pdserve.auth import presenters

GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
]


def insecure_channel(address: str, *extra: tuple[str, int],
                     credentials: Sequence[tuple[str, str]] = ()) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel with pdserve's options (``extra`` added or overriding) that
    sends ``credentials`` (metadata pairs, ``pdserve.auth.metadata``) with every call."""
    interceptors = presenters(credentials) if credentials else None
    return grpc.aio.insecure_channel(address, options=[*GRPC_OPTIONS, *extra],
                                     interceptors=interceptors)
