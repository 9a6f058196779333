"""Configuration of the kvd service: one frozen dataclass, validated on creation.

Every field is a flag of ``python -m services.kvd`` with a ``PDSERVE_KVD_*`` twin (listed in
``pdserve.env``); ``fault_*`` fields are test hooks only.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.server import config_from_flags


@dataclass(frozen=True)
class KvdConfig:
    host: str = "127.0.0.1"
    port: int = 50081
    metrics_port: int = -1
    instance_id: str = ""
    redis_url: str = ""
    node_id: str = ""
    capacity_mib: int = 1024
    ucx_host: str = "127.0.0.1"
    ucx_tls: str = "^cma"
    ucx_error_handling: bool = False
    secret: str = ""
    lease_ms: int = 30000
    index_ttl: int = 300
    index_prefix: str = "pdserve:"
    heartbeat: float = 2.0
    max_batch_blocks: int = 4096
    transfer_timeout: float = 30.0
    max_message_kib: int = 8192
    fault_corrupt_every: int = 0
    fault_send_delay_ms: int = 0

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host: must not be empty")
        positive = {"capacity_mib": self.capacity_mib, "lease_ms": self.lease_ms,
                    "index_ttl": self.index_ttl, "heartbeat": self.heartbeat,
                    "max_batch_blocks": self.max_batch_blocks,
                    "transfer_timeout": self.transfer_timeout,
                    "max_message_kib": self.max_message_kib}
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be > 0, got {value}")
        if self.max_batch_blocks > 1 << 20:
            raise ValueError(f"--max-batch-blocks: at most {1 << 20}, got {self.max_batch_blocks}")
        if self.fault_corrupt_every < 0 or self.fault_send_delay_ms < 0:
            raise ValueError("--fault-corrupt-every / --fault-send-delay-ms: must be >= 0")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis-url: {self.redis_url!r} is not a redis://, rediss:// or "
                             "unix:// URL")

    @property
    def lease_s(self) -> float:
        return self.lease_ms / 1000

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> KvdConfig:
        return config_from_flags(cls, "kvd", argv)  # type: ignore[no-any-return]
