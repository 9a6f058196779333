"""Configuration of the gateway service: every setting declared once (``pdserve.env``).

Every field is a flag of ``python -m services.gateway`` with a ``PDSERVE_GATEWAY_*`` twin.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.env import (
    ADDRESS,
    NAME,
    STR,
    TOKENS,
    ServiceConfig,
    float_kind,
    int_kind,
    port_setting,
    setting,
)


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    SERVICE = "gateway"

    host: str = setting("127.0.0.1", NAME, "HTTP address to bind")
    port: int = port_setting(8000, "HTTP")
    grpc_port: int = port_setting(0, "gRPC health and reflection")
    router: str = setting("127.0.0.1:50051", ADDRESS, "router gRPC address host:port")
    keys_file: str = setting("", STR,
                             "API keys file (one 'key[,tenant]' a line); empty = no auth")
    api_keys: tuple[str, ...] = setting((), TOKENS,
                                        "API keys, comma-separated (added to the keys file's)")
    model_name: str = setting("", STR, "model id to expose (default: the router's)")
    max_body_bytes: int = setting(4 * 1024 * 1024, int_kind(1024), "largest request body")
    request_timeout: float = setting(600.0, float_kind(0.1),
                                     "seconds before a request is abandoned")
    max_choices: int = setting(64, int_kind(1), "most choices (n x prompts) in one request")
    instance_id: str = setting("", STR, "id in logs and traces")
