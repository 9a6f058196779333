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
    # Servers accept the keepalive pings below (by default a ping more often than every 5
    # minutes is abuse, answered by closing the connection).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
]
# For clients whose peers may vanish behind a silent network (a partitioned or lost node:
# nothing resets the TCP connection, so a call in flight would hang until its deadline): an
# HTTP/2 ping every 2 s, and a connection whose ping goes unanswered 2 s is closed, failing
# its calls UNAVAILABLE within about 4 s.
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0))


def insecure_channel(address: str, *extra: tuple[str, int],
                     credentials: Sequence[tuple[str, str]] = ()) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel with pdserve's options (``extra`` added or overriding) that
    sends ``credentials`` (metadata pairs, ``pdserve.auth.metadata``) with every call."""
    interceptors = presenters(credentials) if credentials else None
    return grpc.aio.insecure_channel(address, options=[*GRPC_OPTIONS, *extra],
                                     interceptors=interceptors)
