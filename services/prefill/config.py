"""Configuration of the prefill service: one frozen dataclass, validated on creation.

Every field is a flag of ``python -m services.prefill`` with a ``PDSERVE_*`` twin
(listed in ``pdserve.env``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.server import config_from_flags


@dataclass(frozen=True)
class PrefillConfig:
    host: str = '127.0.0.1'
    port: int = 50061
    metrics_port: int = -1
    instance_id: str = ''
    model: str = 'tiny'
    dtype: str = 'auto'
    role: str = 'prefill'
    kvd: str = ''
    block_size: int = 16
    num_blocks: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_queued: int = 256
    max_prompt_tokens: int = 0
    attention_backend: str = 'auto'
    threads: int = 0
    redis_url: str = ''
    advertise: str = ''

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host: must not be empty")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> PrefillConfig:
        return config_from_flags(cls, "prefill", argv)  # type: ignore[no-any-return]
