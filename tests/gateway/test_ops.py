"""What operators see: /health, /metrics, /openapi.json, and the real process (ready line,
gRPC health, SIGTERM, one-line flag errors)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.gateway.conftest import Stack
from tests.gateway.fake_router import MODEL

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"^pdserve gateway listening on 127\.0\.0\.1:(\d+) "
                   r"\(grpc health on 127\.0\.0\.1:(\d+)\)$")


def test_health(http: httpx.Client) -> None:
    resp = http.get("/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


def test_metrics(stack: Stack, http: httpx.Client) -> None:
    stack.client().completions.create(model=MODEL, prompt="x")
    with pytest.raises(Exception):  # noqa: B017 - any client error; the metric is the point
        stack.client().completions.create(model=MODEL, prompt="busy")
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert re.search(r'pdserve_gateway_requests_total\{endpoint="completions",status="200"\} '
                     r"[1-9]", text)
    assert 'pdserve_gateway_requests_total{endpoint="completions",status="503"}' in text
    assert 'pdserve_gateway_router_errors_total{code="UNAVAILABLE"}' in text
    assert re.search(r'pdserve_gateway_ttft_seconds_count\{endpoint="completions"\} [1-9]', text)
    assert 'pdserve_gateway_request_seconds_bucket{endpoint="completions",le="0.001"}' in text
    assert re.search(r'pdserve_gateway_tokens_total\{kind="completion"\} [1-9]', text)


def test_openapi(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= \
        set(doc["paths"])
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    schemas = doc["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "429" in doc["paths"]["/v1/completions"]["post"]["responses"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}", "PYTHONUNBUFFERED": "1"}


def test_process_ready_line_health_and_sigterm(stack: Stack) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--port", "0", "--grpc-port", "0",
         "--router", stack.router_address, "--api-keys", "k1"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        match = READY.match(proc.stdout.readline().rstrip("\n"))
        assert match, "no ready line"
        http_port, grpc_port = int(match.group(1)), int(match.group(2))
        assert http_port > 0 and grpc_port > 0
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        base = f"http://127.0.0.1:{http_port}"
        assert httpx.get(f"{base}/health").status_code == 200
        out = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x"},
                         headers={"Authorization": "Bearer k1"}).json()
        assert out["choices"][0]["finish_reason"] == "stop"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 5
        assert proc.stdout.read() == ""  # exactly one line on stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("args", "needle"), [
    (["--router", "nowhere"],
     "--router: invalid value 'nowhere' (accepted: host:port, or embedded)"),
    (["--router-flags", "--decode h:1"], "--router-flags: only with --router embedded"),
    (["--router", "embedded", "--router-flags", "--policy nope"],
     "--policy: invalid value 'nope'"),
    (["--router", "embedded"], "--router-flags: --prefill/--decode/--redis-url: no instances"),
    (["--http", "h2"], "--http: invalid value 'h2'"),
    (["--keys-file", "/no/such/keys"], "--keys-file: cannot read '/no/such/keys'"),
    (["--request-timeout", "0"], "--request-timeout: invalid value '0'"),
])
def test_bad_flags_exit_with_one_line(args: list[str], needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "services.gateway", *args], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
