"""Configuration of the gateway service: one frozen dataclass, validated on creation.

Every field is a flag of ``python -m services.gateway`` with a ``PDSERVE_GATEWAY_*`` twin
(listed in ``pdserve.env``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.server import config_from_flags


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # HTTP; 0 picks a free one
    grpc_port: int = 0  # grpc.health.v1 and reflection
    router: str = "127.0.0.1:50051"
    keys_file: str = ""
    api_keys: tuple[str, ...] = ()
    model_name: str = ""  # alias exposed for the router's (first) model; "" = the router's ids
    max_body_bytes: int = 4194304
    request_timeout: float = 600.0  # deadline of every router call, seconds
    max_choices: int = 64  # n x prompts of one request
    instance_id: str = ""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host: must not be empty")
        for name in ("port", "grpc_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"--{name.replace('_', '-')}: {value} is not a port (0..65535)")
        host, sep, port = self.router.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--router: expected host:port, got {self.router!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes: must be >= 1024, got {self.max_body_bytes}")
        if not self.request_timeout > 0:
            raise ValueError(f"--request-timeout: must be > 0, got {self.request_timeout}")
        if self.max_choices < 1:
            raise ValueError(f"--max-choices: must be >= 1, got {self.max_choices}")
        if any(not k or any(c.isspace() for c in k) for k in self.api_keys):
            raise ValueError("--api-keys: keys must be non-empty and without spaces")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> GatewayConfig:
        return config_from_flags(cls, "gateway", argv)  # type: ignore[no-any-return]
