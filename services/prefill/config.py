"""Configuration of the prefill service: one frozen dataclass, validated on creation.

Every field is a flag of ``python -m services.prefill`` with a ``PDSERVE_PREFILL_*`` twin
(listed in ``pdserve.env``); the fields are shared with the decode service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.server import config_from_flags
from pdserve.serving.config import EngineServiceConfig


@dataclass(frozen=True)
class PrefillConfig(EngineServiceConfig):
    port: int = 50061
    role: str = "prefill"

    ROLES: ClassVar[tuple[str, ...]] = ("prefill", "flex")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> PrefillConfig:
        return config_from_flags(cls, "prefill", argv)  # type: ignore[no-any-return]
