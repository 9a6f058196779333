"""``pdserve up``'s engine placement: CPU sets, the device of each engine and its share of it.

    --prefill-cpus '0;1'                    one CPU set per instance, cycled

    --device cuda                           every engine on cuda (cuda:0)
    --prefill-devices cuda:0 --decode-devices cuda:1,cuda:2     per engine, cycled

Engines sharing one GPU split ``--gpu-memory-utilization`` (default 0.9) equally unless it is
given per engine (``--engine-arg=--gpu-memory-utilization=...`` overrides both).
"""

from __future__ import annotations

import re
from collections import Counter

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
DEFAULT_UTILIZATION = 0.9


def parse_cpus(spec: str) -> list[set[int]]:
    """``"0;1"`` -> [{0}, {1}]; ``"0-1"`` -> [{0, 1}]; one set per instance, cycled."""
    groups: list[set[int]] = []
    for group in filter(None, spec.split(";")):
        cpus: set[int] = set()
        for part in group.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        groups.append(cpus)
    return groups


def parse_devices(flag: str, spec: str) -> list[str]:
    """``"cuda:0,cuda:1"`` -> ["cuda:0", "cuda:1"]; SystemExit naming ``flag`` on a bad one."""
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    for device in devices:
        if not _DEVICE.fullmatch(device):
            raise SystemExit(f"pdserve up: error: {flag}: {device!r} is not cpu, cuda or "
                             "cuda:N")
    return devices


def _canonical(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def place(default: str, per_engine: list[str], count: int) -> list[str]:
    """The device of each of ``count`` engines: the list cycled, else ``default``."""
    return [per_engine[i % len(per_engine)] if per_engine else default for i in range(count)]


def engine_flags(devices: list[str], utilization: float) -> list[list[str]]:
    """``--device`` (and on CUDA ``--gpu-memory-utilization``) for each engine, in order."""
    sharing = Counter(_canonical(d) for d in devices)
    flags = []
    for device in devices:
        if device == "cpu":
            flags.append(["--device", device])
            continue
        share = utilization or DEFAULT_UTILIZATION / sharing[_canonical(device)]
        flags.append(["--device", device, "--gpu-memory-utilization", f"{share:.3f}"])
    return flags
