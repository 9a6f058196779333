"""Configuration of the router service: one frozen dataclass, validated on creation.

Every field is a flag of ``python -m services.router`` with a ``PDSERVE_*`` twin
(listed in ``pdserve.env``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.server import config_from_flags


@dataclass(frozen=True)
class RouterConfig:
    host: str = '127.0.0.1'
    port: int = 50051
    metrics_port: int = -1
    instance_id: str = ''
    redis_url: str = ''
    model: str = 'tiny'
    policy: str = 'cache_aware'
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    block_size: int = 16
    max_prompt_tokens: int = 32768
    max_tokens: int = 4096
    max_concurrent: int = 1024
    quotas_file: str = ''
    max_retries: int = 2
    poll_interval: float = 1.0

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host: must not be empty")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> RouterConfig:
        return config_from_flags(cls, "router", argv)  # type: ignore[no-any-return]
