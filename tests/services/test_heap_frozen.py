"""Every service puts its start-up heap out of the cyclic collector's reach before it serves
(``pdserve.server.freeze_heap``): in an engine, a full collection of the ~237k objects alive
after start-up (libraries, the model) took ~100 ms and came every few seconds of decoding,
stalling every stream. ``PDSERVE_GC_FREEZE=0`` leaves it to the collector (the bench's
``gc-freeze`` comparison). Real processes: an engine without a kvd (colocated) and a kvd."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve_bench.configs import load_config
from tests.services.harness import ROOT

ENGINE = ("services.decode", "--model", "tiny", "--role", "colocated", "--threads", "1")
KVD = ("services.kvd", "--capacity-mib", "8")


def _log_until_ready(argv: tuple[str, ...], **extra_env: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}", "PDSERVE_LOG_LEVEL": "info",
           "PYTHONUNBUFFERED": "1", **extra_env}
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", *argv, "--host", "127.0.0.1", "--port", "0",
                             "--metrics-port", "0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return "".join(lines)


@pytest.mark.parametrize("argv", [ENGINE, KVD], ids=["engine", "kvd"])
def test_a_service_freezes_its_start_up_heap_before_it_serves(argv: tuple[str, ...]) -> None:
    text = _log_until_ready(argv)
    found = re.search(r"heap frozen objects=(\d+)", text)
    assert found, f"no 'heap frozen' line before the ready line:\n{text[-2000:]}"
    assert int(found.group(1)) > 10_000  # the libraries' objects at least


def test_pdserve_gc_freeze_0_leaves_the_heap_to_the_collector() -> None:
    text = _log_until_ready(KVD, PDSERVE_GC_FREEZE="0")
    assert "heap left to the cyclic collector (PDSERVE_GC_FREEZE=0)" in text
    assert "heap frozen" not in text


def test_the_gc_freeze_bench_compares_each_stack_with_itself_unfrozen() -> None:
    cfg = load_config(Path(ROOT) / "bench" / "configs" / "gc-freeze.toml")
    for c in cfg.comparisons:
        base, cand = cfg.stacks[c.baseline], cfg.stacks[c.candidate]
        assert base.args == cand.args and c.metric == "itl_p99_ms"
        assert base.env == {"PDSERVE_GC_FREEZE": "0"} and cand.env == {}
    assert {c.candidate for c in cfg.comparisons} == {"colocated", "disaggregated"}
