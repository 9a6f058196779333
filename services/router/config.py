"""Configuration of the router service: one frozen dataclass, validated on creation.

Every field is a flag of ``python -m services.router`` with a ``PDSERVE_*`` twin
(listed in ``pdserve.env``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.env import is_host_port
from pdserve.server import config_from_flags

POLICIES = ("cache_aware", "least_load", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = -1
    instance_id: str = ""
    redis_url: str = ""
    model: str = "tiny"
    policy: str = "cache_aware"
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    block_size: int = 16
    max_prompt_tokens: int = 32768
    max_tokens: int = 4096
    max_concurrent: int = 1024
    quotas_file: str = ""
    max_retries: int = 2
    poll_interval: float = 1.0
    registry_prefix: str = "pdserve:"
    index_prefix: str = "pdserve:"
    index_timeout: float = 0.05

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host: must not be empty")
        if not self.model:
            raise ValueError("--model: must not be empty")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        for flag, addresses in (("--prefill", self.prefill), ("--decode", self.decode)):
            object.__setattr__(self, flag[2:], tuple(addresses))
            for address in addresses:
                if not is_host_port(address):
                    raise ValueError(f"{flag}: {address!r} is not host:port")
        for name in ("block_size", "max_prompt_tokens", "max_tokens", "max_concurrent"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries: must be >= 0, got {self.max_retries}")
        if not self.poll_interval > 0:
            raise ValueError(f"--poll-interval: must be > 0, got {self.poll_interval}")
        if not self.index_timeout > 0:
            raise ValueError(f"--index-timeout: must be > 0, got {self.index_timeout}")
        if not self.prefill and not self.decode and not self.redis_url:
            raise ValueError("--prefill/--decode/--redis-url: no instances: give static "
                             "instances or a Redis registry")
        if self.quotas_file:
            from services.router.quotas import load_quotas

            load_quotas(self.quotas_file)  # fail at startup, naming the file, not per request

    @property
    def is_static_only(self) -> bool:
        return not self.redis_url

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> RouterConfig:
        return config_from_flags(cls, "router", argv)  # type: ignore[no-any-return]


