"""The configuration both engine services share: one frozen dataclass, validated on creation.

Field names are the flag dests of ``pdserve.env._engine_flags`` (plus the common flags), so
``PrefillConfig``/``DecodeConfig`` only change defaults and the roles they accept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.engine.config import EngineArgs
from pdserve.env import is_host_port


@dataclass(frozen=True)
class EngineServiceConfig:
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = -1
    instance_id: str = ""
    model: str = "tiny"
    dtype: str = "auto"
    role: str = "prefill"
    kvd: str = ""
    block_size: int = 16
    num_blocks: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_queued: int = 256
    max_prompt_tokens: int = 0
    attention_backend: str = "auto"
    threads: int = 0
    redis_url: str = ""
    advertise: str = ""
    max_model_len: int = 0
    default_max_tokens: int = 256
    kvd_secret: str = ""
    kvd_timeout: float = 30.0
    registry_prefix: str = "pdserve:"
    registry_ttl: float = 10.0
    stats_window: float = 10.0

    ROLES: ClassVar[tuple[str, ...]] = ("prefill", "decode", "colocated", "flex")

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host: must not be empty")
        if self.role not in self.ROLES:
            raise ValueError(f"--role: this service runs one of {', '.join(self.ROLES)}, "
                             f"got {self.role!r}")
        if self.kvd and not is_host_port(self.kvd):
            raise ValueError(f"--kvd: must be host:port, got {self.kvd!r}")
        if self.advertise and not is_host_port(self.advertise):
            raise ValueError(f"--advertise: must be host:port, got {self.advertise!r}")
        if self.role in ("prefill", "decode", "flex") and not self.kvd and self.redis_url:
            # Registered disaggregated instances without a kvd could never hand blocks over.
            raise ValueError(f"--kvd: role {self.role} registered in Redis needs the node's kvd")
        self.engine_args()  # raises on a bad engine knob, naming it

    def engine_args(self) -> EngineArgs:
        try:
            return EngineArgs(
                block_size=self.block_size, num_blocks=self.num_blocks or None,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len or None,
                attention_backend=self.attention_backend, dtype=self.dtype)
        except ValueError as exc:
            raise ValueError(f"--{str(exc).replace('_', '-')}") from exc

