"""``pdserve up`` as a real process tree for end-to-end tests: start, parse what it prints,
find its children, stop it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pdserve import auth, stackfile

ROOT = Path(__file__).resolve().parents[2]
_PROC_LINE = re.compile(r"^  (\S+)\s+([\d.]+):(\d+)$")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}:{ROOT / 'libs'}"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("REDIS_URL", None)  # every stack gets its own private redis-server
    return env


@dataclass
class UpStack:
    """One ``pdserve up`` and the addresses it printed."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment
    proc: subprocess.Popen[str] | None = None
    addresses: dict[str, str] = field(default_factory=dict)
    base_url: str = ""
    router: str = ""
    redis_url: str = ""
    secrets_dir: str = ""
    log_dir: str = ""
    metrics: dict[str, str] = field(default_factory=dict)  # service name -> host:port
    lines: list[str] = field(default_factory=list)

    def start(self, timeout: float = 240.0) -> UpStack:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", *self.args], cwd=ROOT,
            env={**child_env(), **self.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True)
        ready = threading.Event()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        if not ready.wait(timeout) or not self.base_url:
            self.stop()
            tail = "\n".join(self.lines[-30:])
            raise RuntimeError(f"pdserve up not ready (waited up to {timeout}s); output:\n{tail}")
        return self

    def _read(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            if m := _PROC_LINE.match(line):
                self.addresses[m.group(1)] = f"{m.group(2)}:{m.group(3)}"
            elif line.startswith("pdserve router: "):
                self.router = line.split(": ", 1)[1]
            elif line.startswith("pdserve redis: "):
                self.redis_url = line.split(": ", 1)[1]
            elif line.startswith("pdserve secrets: "):
                self.secrets_dir = line.split(": ", 1)[1]
            elif line.startswith("pdserve logs: "):
                self.log_dir = line.split(": ", 1)[1]
            elif line.startswith("pdserve metrics: "):
                pairs = (p.split("=", 1) for p in line.split(": ", 1)[1].split())
                self.metrics = {name: address for name, address in pairs}
            elif line.startswith("pdserve ready: "):
                self.base_url = line.split(": ", 1)[1]
                ready.set()
        ready.set()  # exited before becoming ready: start() reports its output

    def secret(self, cred: auth.Credential) -> str:
        """One of the stack's credentials, from the directory ``pdserve up`` printed."""
        return (Path(self.secrets_dir) / cred.var).read_text().strip()

    def metadata(self, *creds: auth.Credential) -> tuple[tuple[str, str], ...]:
        return tuple((c.key, self.secret(c)) for c in creds or auth.CREDENTIALS)

    def role_env(self) -> dict[str, str]:
        """The environment of one more of the stack's services (every credential, Redis)."""
        out = child_env()
        out.update({c.var: self.secret(c) for c in auth.CREDENTIALS})
        out["REDIS_URL"] = (Path(self.secrets_dir) / "REDIS_URL").read_text().strip()
        return out

    def channel(self, address: str, *creds: auth.Credential) -> grpc.Channel:
        """A blocking channel to one of the stack's services presenting ``creds`` (default:
        every credential; the test acts for whichever process it needs)."""
        return grpc.intercept_channel(grpc.insecure_channel(address),
                                      _Present(self.metadata(*creds)))

    def children(self) -> dict[str, int]:
        """name -> pid of the supervisor's live children (redis included), from its pidfile
        (``pdserve.stackfile``): ports are bound by the services, not in their command line."""
        assert self.proc is not None
        path = stackfile.run_dir() / f"{self.proc.pid}.json"
        data = json.loads(path.read_text())
        return {c["name"]: c["pid"] for c in data["children"]
                if stackfile.Entry(**c).is_alive()}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def wait_until(check, timeout: float, interval: float = 0.25):  # type: ignore[no-untyped-def]
    """Call ``check`` until it returns a truthy value or raises nothing; return that value."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - retried until the deadline, then re-raised
            last = exc
        time.sleep(interval)
    if last is not None:
        raise last
    raise TimeoutError(f"condition not met within {timeout}s")


class _Present(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Blocking-channel twin of ``pdserve.auth.Presenter``."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self.pairs = pairs

    def _with(self, details: Any) -> Any:
        return _Details(details.method, details.timeout,
                        [*(details.metadata or ()), *self.pairs], details.credentials,
                        details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: float | None, metadata: Any, credentials: Any,
                 wait_for_ready: bool | None, compression: Any) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready = credentials, wait_for_ready
        self.compression = compression
