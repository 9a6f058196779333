"""Configuration of the kvd service: one frozen dataclass, validated on creation.

Every field is a flag of ``python -m services.kvd`` with a ``PDSERVE_*`` twin
(listed in ``pdserve.env``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.server import config_from_flags


@dataclass(frozen=True)
class KvdConfig:
    host: str = '127.0.0.1'
    port: int = 50081
    metrics_port: int = -1
    instance_id: str = ''
    redis_url: str = ''
    node_id: str = ''
    capacity_mib: int = 1024
    ucx_host: str = '127.0.0.1'
    ucx_port: int = 0
    ucx_tls: str = ''
    secret: str = ''
    lease_ms: int = 30000
    index_ttl: int = 300
    heartbeat: float = 2.0
    max_batch_blocks: int = 4096

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host: must not be empty")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> KvdConfig:
        return config_from_flags(cls, "kvd", argv)  # type: ignore[no-any-return]
