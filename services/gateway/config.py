"""Configuration of the gateway service: every setting declared once (``pdserve.env``).

Every field is a flag of ``python -m services.gateway`` with a ``PDSERVE_GATEWAY_*`` twin.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.auth import is_loopback
from pdserve.env import (
    ADDRESS_OR_EMBEDDED,
    EMBEDDED,
    NAME,
    STR,
    TOKENS,
    ConfigError,
    ServiceConfig,
    choice_kind,
    float_kind,
    int_kind,
    port_setting,
    setting,
)
from pdserve.server import LOOPS


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    SERVICE = "gateway"

    host: str = setting("127.0.0.1", NAME, "HTTP address to bind")
    port: int = port_setting(8000, "HTTP")
    grpc_port: int = port_setting(0, "gRPC health and reflection")
    router: str = setting("127.0.0.1:50051", ADDRESS_OR_EMBEDDED,
                          "router gRPC address host:port, or 'embedded': run the router's core "
                          "in this process (configured by --router-flags)")
    router_flags: str = setting("", STR, "with --router embedded: the router's flags, as "
                                "python -m services.router takes them (its PDSERVE_ROUTER_* "
                                "variables apply too), e.g. '--prefill h:p --decode h:p'")
    http: str = setting("auto", choice_kind("auto", "h11", "httptools"),
                        "HTTP/1.1 parser; auto = httptools when installed (pdserve[fast]), "
                        "else h11")
    loop: str = setting("auto", choice_kind(*LOOPS),
                        "event loop; auto = uvloop when installed (pdserve[fast]), else asyncio")
    keys_file: str = setting("", STR, "API keys file (one 'key[,tenant[,cache_group]]' a "
                             "line); none = no auth, allowed on a loopback address only")
    api_keys: tuple[str, ...] = setting((), TOKENS,
                                        "API keys, comma-separated (added to the keys file's)")
    model_name: str = setting("", STR, "model id to expose (default: the router's)")
    max_body_bytes: int = setting(4 * 1024 * 1024, int_kind(1024), "largest request body")
    request_timeout: float = setting(600.0, float_kind(0.1),
                                     "seconds before a request is abandoned")
    body_timeout: float = setting(5.0, float_kind(0.1), "seconds the request body may pause "
                                  "between two chunks before a 408")
    header_timeout: float = setting(10.0, float_kind(0.1), "seconds a connection may take to "
                                    "send its request headers before a 408")
    sse_heartbeat: float = setting(5.0, float_kind(0.05), "seconds of silence after which a "
                                   "stream sends an SSE keep-alive comment")
    max_choices: int = setting(64, int_kind(1), "most choices (n x prompts) in one request")
    instance_id: str = setting("", STR, "id in logs and traces")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.router_flags and self.router != EMBEDDED:
            raise ConfigError(f"--router-flags: only with --router {EMBEDDED} (the router at "
                              f"{self.router} has its own flags)")
        if not (self.keys_file or self.api_keys) and not is_loopback(self.host):
            raise ConfigError(f"--host {self.host}: serving the API on a non-loopback address "
                              "needs API keys (--keys-file or --api-keys); refusing to start "
                              "open to the network")
