"""The CPU as Linux describes it (``/proc/cpuinfo``): its feature flags and its model name, for
the native kernels' choice of instruction set (``attention/cpu_decode.py``) and for the
benchmarks' ``hardware`` field."""

from __future__ import annotations

import platform

CPUINFO = "/proc/cpuinfo"


def _field(name: str, cpuinfo: str) -> str | None:
    """The first ``name : value`` line's value, or None (no such line, no such file)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(name):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def cpu_flags(cpuinfo: str = CPUINFO) -> set[str]:
    """The CPU's feature flags (Linux), or none where they cannot be read."""
    return set((_field("flags", cpuinfo) or "").split())


def cpu_model(cpuinfo: str = CPUINFO) -> str:
    """The CPU's model name (Linux), else what ``platform`` says."""
    return _field("model name", cpuinfo) or platform.processor()
