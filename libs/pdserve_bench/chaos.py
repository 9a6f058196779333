"""A live ``pdserve up`` stack to hurt on purpose: start it, find its children (the stack's
pidfile, ``pdserve.stackfile``), signal one, probe the HTTP API until it answers again, and read
what every kvd and engine still holds. Used by ``pdserve bench faults`` and tests/chaos.

    with ChaosStack(["--prefill", "1", "--decode", "2"]) as stack:
        stack.probe()                                   # one small completion: ok / error
        outcome = stack.recover(lambda: stack.kill("kvd-d0"))   # seconds to first success
        stack.wait_idle()                               # nothing pinned, nothing in use
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc

from pdserve import auth, stackfile
from pdserve.env import REDIS_URL_VAR
from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc, kvd_pb2, kvd_pb2_grpc

_SERVICE_LINE = re.compile(r"^  (\S+)\s+([\d.]+):(\d+)$")
_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Probe:
    ok: bool
    seconds: float
    error: str = ""


@dataclass
class Recovery:
    """After a fault: seconds from it to the first probe sent after it that succeeded, and
    the probes that failed meanwhile (requests lost)."""

    seconds: float
    num_failed: int
    errors: list[str] = field(default_factory=list)


class ChaosStack:
    def __init__(self, args: list[str], ready_timeout: float = 240.0,
                 env: dict[str, str] | None = None) -> None:
        self.args, self.ready_timeout = args, ready_timeout
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.addresses: dict[str, str] = {}
        self.base_url = ""
        self.secrets_dir = ""
        self.lines: list[str] = []
        self._ready = threading.Event()

    # -- life ------------------------------------------------------------------------------
    def __enter__(self) -> ChaosStack:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> ChaosStack:
        env = dict(self.env if self.env is not None else os.environ)
        env["PYTHONPATH"] = f"{_ROOT}:{_ROOT / 'libs'}"
        env.pop(REDIS_URL_VAR, None)  # its own private Redis, which it supervises
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", *self.args], cwd=_ROOT,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(self.ready_timeout) or not self.base_url:
            self.stop()
            raise RuntimeError("pdserve up not ready; its output:\n" + "\n".join(self.lines[-30:]))
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            if m := _SERVICE_LINE.match(line):
                self.addresses[m.group(1)] = f"{m.group(2)}:{m.group(3)}"
            elif line.startswith("pdserve secrets: "):
                self.secrets_dir = line.split(": ", 1)[1]
            elif line.startswith("pdserve ready: "):
                self.base_url = line.split(": ", 1)[1]
                self._ready.set()
        self._ready.set()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for name in self.children():  # a stopped child cannot stop: let it go on first
            self.signal(name, signal.SIGCONT)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    # -- processes -------------------------------------------------------------------------
    def children(self) -> dict[str, int]:
        """name -> pid of the supervisor's live children (redis included), per its pidfile."""
        assert self.proc is not None
        path = stackfile.run_dir() / f"{self.proc.pid}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return {c["name"]: c["pid"] for c in data["children"]
                if stackfile.Entry(**c).is_alive()}

    def signal(self, name: str, sig: int) -> int:
        pid = self.children()[name]
        os.kill(pid, sig)
        return pid

    def kill(self, name: str) -> int:
        return self.signal(name, signal.SIGKILL)

    def wait_restarted(self, name: str, old_pid: int, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.children().get(name)
            if pid is not None and pid != old_pid:
                return pid
            time.sleep(0.1)
        raise TimeoutError(f"{name} was not restarted within {timeout}s")

    # -- the client's view -----------------------------------------------------------------
    def probe(self, max_tokens: int = 4, timeout: float = 15.0, prompt: str = "Hello") -> Probe:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{self.base_url}/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        start = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                json.loads(resp.read())
            return Probe(True, time.monotonic() - start)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            return Probe(False, time.monotonic() - start, f"HTTP {exc.code}: {detail}")
        except (OSError, ValueError) as exc:
            return Probe(False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")

    def recover(self, fault: Callable[[], object], timeout: float = 60.0,
                interval: float = 0.05) -> Recovery:
        """Cause ``fault``, then probe one request at a time until one succeeds."""
        fault()
        start = time.monotonic()
        failed: list[str] = []
        while time.monotonic() - start < timeout:
            result = self.probe()
            if result.ok:
                return Recovery(time.monotonic() - start, len(failed), failed)
            failed.append(result.error)
            time.sleep(interval)
        raise TimeoutError(f"no successful request within {timeout}s of the fault; "
                           f"{len(failed)} failed, the last: {failed[-1] if failed else ''}")

    # -- what is held ----------------------------------------------------------------------
    def _data_md(self) -> tuple[tuple[str, str], ...]:
        return ((auth.DATA.key, (Path(self.secrets_dir) / auth.DATA.var).read_text().strip()),)

    def kvd_stats(self, name: str) -> kvd_pb2.KvdStats:
        with grpc.insecure_channel(self.addresses[name]) as ch:
            return kvd_pb2_grpc.KvdStub(ch).Stats(kvd_pb2.KvdStatsRequest(), timeout=5,
                                                  metadata=self._data_md())

    def held(self) -> dict[str, tuple[int, ...]]:
        """kvds: (pinned, in flight, writing) slots; engines: (queued, running, KV blocks
        used). All zeros on an idle, clean stack; a service not answering (restarting) is
        left out."""
        md = self._data_md()
        out: dict[str, tuple[int, ...]] = {}
        for name, address in self.addresses.items():
            with grpc.insecure_channel(address) as ch:
                try:
                    if name.startswith("kvd-"):
                        k = kvd_pb2_grpc.KvdStub(ch).Stats(kvd_pb2.KvdStatsRequest(),
                                                            timeout=5, metadata=md)
                        out[name] = (k.slots_pinned, k.slots_in_flight, k.slots_writing)
                    elif name.startswith(("prefill-", "decode-")):
                        e = engine_pb2_grpc.EngineStub(ch).Stats(
                            engine_pb2.EngineStatsRequest(), timeout=5, metadata=md)
                        out[name] = (e.queue_depth, e.num_running, e.kv_blocks_used)
                except grpc.RpcError:
                    continue
        return out

    def wait_idle(self, timeout: float = 10.0, names: tuple[str, ...] = ()) -> dict[
            str, tuple[int, ...]]:
        """``held()`` once everything (or every one of ``names``) answers with zeros
        (releases finish asynchronously); the last reading if not within ``timeout``."""
        want = names or tuple(n for n in self.addresses if n.startswith(
            ("kvd-", "prefill-", "decode-")))
        deadline = time.monotonic() + timeout
        while True:
            now = self.held()
            if all(n in now and not any(now[n]) for n in want):
                return now
            if time.monotonic() >= deadline:
                return now
            time.sleep(0.2)
