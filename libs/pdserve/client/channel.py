"""How the client's channel is built: pdserve's message limits, gRPC's own retry policy (a
service config) and transport security.

Retries are gRPC's, not a loop in the client: the channel's service config retries
``UNAVAILABLE`` with exponential backoff, and only while nothing of the answer has arrived (a
stream that already delivered tokens is never replayed). A server that knows when capacity
returns says so with ``grpc-retry-pushback-ms`` (pdserve servers send it with every RetryInfo),
which gRPC honours instead of its backoff. Deadlines bound the retries too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdserve.channel import GRPC_OPTIONS

ROUTER_SERVICE = "pdserve.v1.Router"
MAX_ATTEMPTS = 5  # gRPC's ceiling: larger values are treated as 5


@dataclass(frozen=True)
class Retry:
    """gRPC retry policy of the router's calls (``max_attempts`` counts the first one)."""

    max_attempts: int = 4
    initial_backoff: float = 0.2  # seconds, randomized by gRPC (0..backoff)
    max_backoff: float = 5.0
    backoff_multiplier: float = 2.0
    status_codes: tuple[str, ...] = ("UNAVAILABLE",)

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= MAX_ATTEMPTS:
            raise ValueError(f"Retry.max_attempts: must be in 2..{MAX_ATTEMPTS} (use retry=None "
                             f"for no retries), got {self.max_attempts}")
        if not 0 < self.initial_backoff <= self.max_backoff:
            raise ValueError(f"Retry.initial_backoff: must be > 0 and <= max_backoff "
                             f"({self.max_backoff}), got {self.initial_backoff}")
        if self.backoff_multiplier <= 0:
            raise ValueError(f"Retry.backoff_multiplier: must be > 0, "
                             f"got {self.backoff_multiplier}")
        unknown = [c for c in self.status_codes if c not in grpc.StatusCode.__members__]
        if unknown or not self.status_codes:
            raise ValueError(f"Retry.status_codes: must be gRPC status names, got {unknown}")

    def service_config(self) -> str:
        """The channel's service config (JSON) applying this policy to every Router call."""
        return json.dumps({"methodConfig": [{
            "name": [{"service": ROUTER_SERVICE}],
            "retryPolicy": {
                "maxAttempts": self.max_attempts,
                "initialBackoff": f"{self.initial_backoff}s",
                "maxBackoff": f"{self.max_backoff}s",
                "backoffMultiplier": self.backoff_multiplier,
                "retryableStatusCodes": list(self.status_codes),
            },
        }]})


@dataclass(frozen=True)
class TLS:
    """Transport security. No root certificates: the system's roots. A private key and
    certificate chain: mutual TLS. ``server_name``: the name to check in the server's
    certificate when it differs from the target's host."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_files(cls, ca: str | Path | None = None, cert: str | Path | None = None,
                   key: str | Path | None = None, server_name: str | None = None) -> TLS:
        """PEM files: ``ca`` to verify the server, ``cert`` and ``key`` for mutual TLS."""

        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return cls(read(ca), read(key), read(cert), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.private_key is None) != (self.certificate_chain is None):
            raise ValueError("TLS: give both private_key and certificate_chain (mutual TLS) "
                             "or neither")
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key,
                                            self.certificate_chain)


def channel_options(retry: Retry | None, tls: TLS | None,
                    extra: tuple[tuple[str, Any], ...] = ()) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [*GRPC_OPTIONS]
    if retry is None:
        options.append(("grpc.enable_retries", 0))
    else:
        options += [("grpc.enable_retries", 1), ("grpc.service_config", retry.service_config())]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return [*options, *extra]


def channel_credentials(tls: TLS | None, call_credentials: grpc.CallCredentials | None
                        ) -> grpc.ChannelCredentials | None:
    """None for a plaintext channel. Call credentials (a token on every call) need TLS: gRPC
    never sends them in the clear."""
    if tls is None:
        if call_credentials is not None:
            raise ValueError("call_credentials: need tls (gRPC sends credentials only over "
                             "a secure channel)")
        return None
    creds = tls.credentials()
    if call_credentials is not None:
        creds = grpc.composite_channel_credentials(creds, call_credentials)
    return creds
