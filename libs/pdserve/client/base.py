"""What the sync and asyncio clients share: their settings and how one call's arguments
(deadline, metadata, per-call credentials) are put together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

import grpc

from pdserve import auth
from pdserve.client.channel import TLS, Retry, channel_credentials, channel_options

DEFAULT_TARGET = "127.0.0.1:50051"  # the router's default --port
DEFAULT_TIMEOUT = 300.0  # seconds; every call has a deadline unless told otherwise
Timeout = float | None | EllipsisType  # ... = the client's default; None = no deadline
Metadata = Sequence[tuple[str, str | bytes]]


@dataclass(frozen=True)
class Settings:
    """One client's channel and call defaults (see ``Client``)."""

    target: str
    model: str
    timeout: float | None
    retry: Retry | None
    tls: TLS | None
    call_credentials: grpc.CallCredentials | None
    metadata: tuple[tuple[str, str | bytes], ...]
    options: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, target: str, model: str, timeout: float | None, retry: Retry | None,
           tls: TLS | bool | None, call_credentials: grpc.CallCredentials | None,
           metadata: Metadata, options: Sequence[tuple[str, Any]]) -> Settings:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout: must be > 0 seconds or None, got {timeout}")
        given = tuple(metadata)
        if not any(key == auth.CLIENT.key for key, _ in given):
            # The router's client credential, when this process holds one (pdserve.auth).
            given += auth.metadata([auth.CLIENT])
        return cls(target, model, timeout, retry, TLS() if tls is True else (tls or None),
                   call_credentials, given, tuple(options))

    @property
    def channel_options(self) -> list[tuple[str, Any]]:
        return channel_options(self.retry, self.tls, self.options)

    @property
    def credentials(self) -> grpc.ChannelCredentials | None:
        return channel_credentials(self.tls, self.call_credentials)

    def call_kwargs(self, timeout: Timeout, metadata: Metadata | None,
                    credentials: grpc.CallCredentials | None) -> dict[str, Any]:
        """Keyword arguments of one stub call: the deadline, metadata and call credentials."""
        seconds = self.timeout if timeout is ... else timeout
        if seconds is not None and seconds <= 0:
            raise ValueError(f"timeout: must be > 0 seconds or None, got {seconds}")
        if credentials is not None and self.tls is None:
            raise ValueError("credentials: per-call credentials need a TLS channel (tls=...)")
        merged = (*self.metadata, *(metadata or ()))
        return {"timeout": seconds, "metadata": merged or None, "credentials": credentials}
