"""Supervised children start through ``child_argv`` (no ``preexec_fn``): pinned when asked,
SIGTERM'd when their supervisor dies even by SIGKILL, a missing command named; and a parent
holding a gRPC channel starts them without the fork-time abort of grpc/grpc#43055."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.procs import Proc, child_argv
from tests.conftest import is_running

PY = sys.executable


def test_a_child_is_pinned_when_asked() -> None:
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run(child_argv([PY, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                    {cpu}), capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{cpu}]"
    out = subprocess.run(child_argv([PY, "-c", "import os; print(len(os.sched_getaffinity(0)))"]),
                         capture_output=True, text=True, check=True).stdout
    assert int(out) == len(os.sched_getaffinity(0))  # not pinned: this process's CPUs


def test_a_child_dies_with_its_supervisor_even_by_sigkill() -> None:
    # the supervisor: starts a long child through child_argv, prints its pid, waits
    code = ("import subprocess, sys, time\n"
            "from pdserve.procs import child_argv\n"
            "p = subprocess.Popen(child_argv(['sleep', '120']))\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(120)\n")
    sup = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert sup.stdout is not None
        child = int(sup.stdout.readline())
        deadline = time.monotonic() + 10
        cmdline = Path(f"/proc/{child}/cmdline")
        while "sleep" not in cmdline.read_text():  # exec'd past the shim
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sup.kill()
        sup.wait()
        deadline = time.monotonic() + 10
        while is_running(child):
            assert time.monotonic() < deadline, "the child outlived its SIGKILLed supervisor"
            time.sleep(0.05)
    finally:
        sup.kill()


def test_a_missing_command_is_named() -> None:
    res = subprocess.run(child_argv(["/nonexistent/pdserve-x", "--flag"]), capture_output=True,
                         text=True)
    assert res.returncode == 1
    assert res.stderr.strip() == ("pdserve: cannot run /nonexistent/pdserve-x: "
                                  "No such file or directory")
    with pytest.raises(ValueError, match="child_argv: no command"):
        child_argv([])


def test_children_start_beside_an_idle_grpc_channel() -> None:
    """A supervisor that has made a gRPC call and holds the channel idle starts children: with
    a ``preexec_fn`` (fork, gRPC's fork handlers run) ~1% of them aborted before exec on
    ``epoll_wait error: Bad file descriptor`` here (grpcio 1.85: this test with the old
    ``preexec_fn`` start failed 4 runs of 4); through ``child_argv`` every one must run."""
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        for i in range(300):
            proc = Proc(f"c{i}", ["echo", "pdserve c listening on 127.0.0.1:1"], 1)
            proc.start(dict(os.environ))
            assert proc.popen is not None
            out, _ = proc.popen.communicate(timeout=30)
            assert proc.popen.returncode == 0 and "listening" in out, (i, proc.log_tail)
    finally:
        channel.close()
        server.stop(None)
