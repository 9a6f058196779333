"""Configuration of the decode service: one frozen dataclass, validated on creation.

Every field is a flag of ``python -m services.decode`` with a ``PDSERVE_DECODE_*`` twin
(listed in ``pdserve.env``); the fields are shared with the prefill service. Role
``colocated`` makes this one engine do both phases (the baseline, no kvd needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.server import config_from_flags
from pdserve.serving.config import EngineServiceConfig


@dataclass(frozen=True)
class DecodeConfig(EngineServiceConfig):
    port: int = 50071
    role: str = "decode"

    ROLES: ClassVar[tuple[str, ...]] = ("decode", "colocated", "flex")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> DecodeConfig:
        return config_from_flags(cls, "decode", argv)  # type: ignore[no-any-return]
