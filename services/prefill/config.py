"""Configuration of the prefill service: the engine service's settings with prefill defaults.

Every field is a flag of ``python -m services.prefill`` with a ``PDSERVE_PREFILL_*`` twin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.env import port_setting
from pdserve.roles import Role
from services.engine.config import EngineServiceConfig, role_setting


@dataclass(frozen=True)
class PrefillConfig(EngineServiceConfig):
    SERVICE = "prefill"
    ROLES: ClassVar[tuple[Role, ...]] = (Role.PREFILL, Role.FLEX)
    HOME_ROLE: ClassVar[Role] = Role.PREFILL

    port: int = port_setting(50061)
    role: str = role_setting(Role.PREFILL)
