"""What every pdserve gRPC endpoint agrees on: message limits, and the metadata key that
carries the shared secret. Servers and clients both take their options from here."""

from __future__ import annotations

import grpc

SECRET_KEY = "x-pdserve-secret"
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
]


def insecure_channel(address: str, *extra: tuple[str, int]) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel with pdserve's options (``extra`` added or overriding)."""
    return grpc.aio.insecure_channel(address, options=[*GRPC_OPTIONS, *extra])
