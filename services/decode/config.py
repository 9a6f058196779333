"""Configuration of the decode service: the engine service's settings with decode defaults.

Every field is a flag of ``python -m services.decode`` with a ``PDSERVE_DECODE_*`` twin. Role
``colocated`` makes this one engine do both phases (the baseline, no kvd needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.env import port_setting
from pdserve.roles import Role
from services.engine.config import EngineServiceConfig, role_setting


@dataclass(frozen=True)
class DecodeConfig(EngineServiceConfig):
    SERVICE = "decode"
    ROLES: ClassVar[tuple[Role, ...]] = (Role.DECODE, Role.COLOCATED, Role.FLEX)
    HOME_ROLE: ClassVar[Role] = Role.DECODE

    port: int = port_setting(50071)
    role: str = role_setting(Role.DECODE)
