"""Every service puts its start-up heap out of the cyclic collector's reach before it serves
(``pdserve.server.freeze_heap``): in an engine, a full collection of the ~237k objects alive
after start-up (libraries, the model) took ~100 ms and came every few seconds of decoding,
stalling every stream. Real processes: an engine without a kvd (colocated) and a kvd."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.services.harness import ROOT

READY = re.compile(r"listening on")


def _frozen_at_start(*argv: str) -> int:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}", "PDSERVE_LOG_LEVEL": "info",
           "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", *argv, "--host", "127.0.0.1", "--port", "0",
                             "--metrics-port", "0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if READY.search(line):
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = "".join(lines)
    found = re.search(r"heap frozen objects=(\d+)", text)
    assert found, f"no 'heap frozen' line before the ready line:\n{text[-2000:]}"
    return int(found.group(1))


@pytest.mark.parametrize("argv", [
    ("services.decode", "--model", "tiny", "--role", "colocated", "--threads", "1"),
    ("services.kvd", "--capacity-mib", "8"),
], ids=["engine", "kvd"])
def test_a_service_freezes_its_start_up_heap_before_it_serves(argv: tuple[str, ...]) -> None:
    assert _frozen_at_start(*argv) > 10_000  # the libraries' objects at least
