"""Real kvd processes for the tests: each one ``python -m services.kvd`` on free loopback ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
BLOCK = dict(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype="float16")  # 4 KiB


class KvdProc:
    """One kvd subprocess; ``address`` once it printed its ready line."""

    def __init__(self, *args: str, node_id: str = "", port: int = 0, secret: str = "",
                 log_level: str = "warning") -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.node_id = node_id or self.address
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}", "PDSERVE_LOG_LEVEL":
               log_level}
        if secret:  # the data-plane credential, as pdserve up hands it over: never a flag
            env["PDSERVE_SECRET"] = secret
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.kvd", "--port", str(self.port), "--metrics-port", "0",
             "--node-id",
             self.node_id, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            rest = self.proc.stdout.read() if self.proc.poll() is not None else ""
            raise RuntimeError(f"kvd did not start: {line}{rest}")
        m = re.search(r"metrics on [^:]+:(\d+)", line)
        self.metrics_port = int(m.group(1)) if m else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        assert self.proc.stdout is not None
        return self.proc.stdout.read()


@pytest.fixture
def kvd_factory(redis_url: str) -> Iterator[tuple[str, list[KvdProc]]]:
    """Start kvds sharing a private Redis and a per-test index prefix; all stopped after."""
    procs: list[KvdProc] = []
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    yield prefix, procs
    for p in procs:
        p.stop()


def common_args(redis_url: str, prefix: str, *extra: str) -> list[str]:
    return ["--redis-url", redis_url, "--index-prefix", prefix, "--heartbeat", "0.2",
            "--capacity-mib", "8", "--transfer-timeout", "3", *extra]
