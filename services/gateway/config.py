"""Configuration of the gateway service: one frozen dataclass, validated on creation.

Every field is a flag of ``python -m services.gateway`` with a ``PDSERVE_*`` twin
(listed in ``pdserve.env``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.server import config_from_flags


@dataclass(frozen=True)
class GatewayConfig:
    host: str = '127.0.0.1'
    port: int = 8000
    grpc_port: int = 0
    router: str = '127.0.0.1:50051'
    keys_file: str = ''
    api_keys: tuple[str, ...] = ()
    model_name: str = ''
    max_body_bytes: int = 4194304
    request_timeout: float = 600.0
    instance_id: str = ''

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host: must not be empty")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> GatewayConfig:
        return config_from_flags(cls, "gateway", argv)  # type: ignore[no-any-return]
