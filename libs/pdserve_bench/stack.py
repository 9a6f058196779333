"""One configuration's stack as a subprocess (``pdserve up <args>``), for ``bench compare``.

Launcher contract: it prints ``pdserve ready: http://<host>:<port>/v1`` once every service is
healthy (and optionally ``pdserve router: <host>:<port>``), and stops everything on SIGINT or
SIGTERM. Both output streams go to a log file; the stderr tail goes into every error.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from pdserve import auth
from pdserve.auth import CLIENT

READY = re.compile(r"pdserve ready: (\S+)")
ROUTER = re.compile(r"pdserve router: (\S+)")
SECRETS = re.compile(r"pdserve secrets: (\S+)")


class StackError(RuntimeError):
    """The stack could not be started (exited early or never became ready)."""


@dataclass(frozen=True)
class StackInfo:
    base_url: str
    router: str | None
    pid: int
    # The router's client credential (pdserve.auth) when the stack printed where it keeps it.
    router_credentials: tuple[tuple[str, str], ...] = ()


class StackProcess:
    """``with StackProcess(...) as info:`` starts, waits for ready, and always stops it."""

    def __init__(self, name: str, argv: list[str], *, env: dict[str, str], log_path: Path,
                 ready_timeout_s: float, stop_timeout_s: float = 60.0) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.log_path, self.ready_timeout_s = log_path, ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.tail: deque[str] = deque(maxlen=30)
        self.ready = threading.Event()
        self.base_url: str | None = None
        self.router: str | None = None
        self.secrets_dir: str | None = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._log: IO[str] | None = None

    def __enter__(self) -> StackInfo:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _pump(self, stream: IO[str], log: IO[str], is_stderr: bool) -> None:
        for line in stream:
            with self._lock:
                log.write(line)
                log.flush()
                if is_stderr or "error" in line.lower():
                    self.tail.append(line.rstrip())
            if (m := ROUTER.search(line)) and self.router is None:
                self.router = m.group(1)
            if (m := SECRETS.search(line)) and self.secrets_dir is None:
                self.secrets_dir = m.group(1)
            if (m := READY.search(line)) and not self.ready.is_set():
                self.base_url = m.group(1).rstrip("/")
                self.ready.set()

    def start(self) -> StackInfo:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self._log = self.log_path.open("w", encoding="utf-8")
        try:
            # A new session: the launcher's own children never see our terminal's Ctrl-C twice.
            self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True, bufsize=1)
        except OSError as e:
            log.close()
            raise StackError(f"{self.name}: cannot run {' '.join(self.argv)!r}: {e}") from e
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for stream, is_err in ((self.proc.stdout, False), (self.proc.stderr, True)):
            t = threading.Thread(target=self._pump, args=(stream, log, is_err), daemon=True)
            t.start()
            self._threads.append(t)
        deadline = time.monotonic() + self.ready_timeout_s
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None:
                for t in self._threads:
                    t.join(timeout=2)
                raise StackError(f"{self.name}: `{' '.join(self.argv)}` exited with code "
                                 f"{self.proc.returncode} before it was ready"
                                 f"{self._tail_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise StackError(f"{self.name}: no 'pdserve ready:' line within "
                                 f"{self.ready_timeout_s:g} s (ready_timeout_s){self._tail_text()}")
        assert self.base_url is not None
        credentials: tuple[tuple[str, str], ...] = ()
        if self.secrets_dir is not None:
            held = auth.secrets({f"{CLIENT.var}_FILE": str(Path(self.secrets_dir) / CLIENT.var)})
            credentials = auth.metadata([CLIENT], held)
        return StackInfo(self.base_url, self.router, self.proc.pid, credentials)

    def _tail_text(self) -> str:
        with self._lock:
            lines = list(self.tail)[-15:]
        body = "\n  ".join(lines) if lines else "(nothing on stderr)"
        return f"; last log lines ({self.log_path}):\n  {body}"

    def stop(self) -> int | None:
        """SIGINT (the launcher's clean stop), then SIGTERM, then SIGKILL of its group."""
        proc = self.proc
        if proc is None:
            return None
        for sig, wait_s in ((signal.SIGINT, self.stop_timeout_s), (signal.SIGTERM, 10.0)):
            if proc.poll() is not None:
                break
            proc.send_signal(sig)
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # our own child's session, nothing else
            proc.wait()
        for t in self._threads:
            t.join(timeout=5)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        if self._log is not None:
            self._log.close()
        self.proc = None
        return proc.returncode
