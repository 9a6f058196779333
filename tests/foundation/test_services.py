"""Each service starts as a real process on port 0, serves grpc.health.v1 and reflection,
prints its ready line, exits cleanly on SIGTERM; bad flags and env values exit with one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(
    r"pdserve (\w+) listening on ([\d.]+):(\d+)(?: \(grpc health on [\d.]+:(\d+)\))?")
EXPECTED = {
    "router": {"pdserve.v1.Router"},
    "prefill": {"pdserve.v1.Prefill", "pdserve.v1.Engine"},
    "decode": {"pdserve.v1.Decode", "pdserve.v1.Engine"},
    "kvd": {"pdserve.v1.Kvd"},
    "gateway": set(),
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}:{ROOT / 'libs'}"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("REDIS_URL", None)
    return env


def _start(service: str) -> tuple[subprocess.Popen[str], int]:
    args = [sys.executable, "-m", f"services.{service}", "--host", "127.0.0.1", "--port", "0"]
    if service == "gateway":
        args += ["--grpc-port", "0"]
    if service == "router":  # a router needs somewhere to route: one static (absent) engine
        args += ["--decode", "127.0.0.1:1"]
    proc = subprocess.Popen(args, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = READY.search(line)
    if match is None:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"{service}: no ready line, got {line!r}; stderr: {err[-2000:]}")
    assert match.group(1) == service
    port = int(match.group(4) or match.group(3))
    assert int(match.group(3)) > 0
    return proc, port


def _reflected_services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    return {s.name for r in responses for s in r.list_services_response.service}


@pytest.mark.parametrize("service", sorted(EXPECTED))
def test_service_serves_health_and_reflection_and_stops(service: str) -> None:
    proc, port = _start(service)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            listed = _reflected_services(channel)
            assert EXPECTED[service] <= listed
            assert "grpc.health.v1.Health" in listed
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - start < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_service_that_stopped_freezes_its_heap_before_the_interpreter_exits() -> None:
    """The interpreter's last collection would walk the whole heap of a process that is
    ending (most of an engine's time from SIGTERM to exit): ``run_main`` freezes it once the
    service has stopped, and the exit handlers still run."""
    code = ("import atexit, gc\n"
            "from pdserve.server import run_main\n"
            "from services.kvd.config import KvdConfig\n"
            "async def run(config): print('frozen while serving:', gc.get_freeze_count() > 0)\n"
            "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
            "raise SystemExit(run_main(KvdConfig, run, []))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["frozen while serving: False", "frozen at exit: True"]


@pytest.mark.parametrize(("service", "args", "env", "needle"), [
    ("router", ["--policy", "random"], {}, "--policy: invalid value 'random' (accepted: "
                                           "cache_aware, least_load, round_robin)"),
    ("kvd", ["--port", "99999"], {},
     "--port: invalid value '99999' (accepted: an integer 0..65535)"),
    ("prefill", [], {"PDSERVE_PREFILL_MAX_NUM_SEQS": "lots"},
     "PDSERVE_PREFILL_MAX_NUM_SEQS: invalid value 'lots' (accepted: an integer >= 1)"),
    ("decode", [], {"PDSERVE_LOG_FORMAT": "xml"},
     "PDSERVE_LOG_FORMAT: invalid value 'xml' (accepted: text, json)"),
    ("router", ["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
])
def test_bad_flag_or_env_exits_with_one_line(service: str, args: list[str],
                                              env: dict[str, str], needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", f"services.{service}", *args], cwd=ROOT,
                          env={**_env(), **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]


@pytest.mark.parametrize("service", sorted(EXPECTED))
def test_help_lists_flags_with_env_twins(service: str) -> None:
    proc = subprocess.run([sys.executable, "-m", f"services.{service}", "--help"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "--port" in proc.stdout and f"PDSERVE_{service.upper()}_PORT" in proc.stdout


def test_json_logs() -> None:
    env = {**_env(), "PDSERVE_LOG_FORMAT": "json"}
    proc = subprocess.Popen([sys.executable, "-m", "services.kvd", "--port", "0"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert READY.search(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    import json

    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert records and all(r["service"] == "kvd" for r in records)
    assert any(r["msg"] == "shutting down" for r in records)
