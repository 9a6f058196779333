"""Latency the gateway adds: client -> gateway -> router versus client -> router, on loopback.

Not a test (pytest does not collect it): run ``python tests/gateway/bench_gateway.py [N]``.
The scripted router (``fake_router``) and the real gateway (``python -m services.gateway``) run
as their own processes; requests go one at a time, each path in turn, so drift in the machine's
load hits every path alike. Prints one JSON line, then a table.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

from pdserve.proto.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402

_ROUTER = """
import asyncio
from tests.gateway.conftest import _start_router
from tests.gateway.fake_router import FakeRouter

async def main():
    router = FakeRouter()
    svc = await _start_router(router)
    print(svc.port, flush=True)
    while True:
        await asyncio.sleep(1)
        router.requests.clear()
        router.metadata.clear()

asyncio.run(main())
"""


def _spawn(argv: list[str]) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}"}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline()


def _http(port: int, path: str, body: dict[str, object]) -> Callable[[], float]:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    payload = json.dumps(body)

    def send() -> float:
        t0 = time.perf_counter()
        conn.request("POST", path, payload, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        assert response.status == 200, response.status
        return time.perf_counter() - t0

    return send


def _grpc(port: int) -> Callable[[], float]:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    request = router_pb2.GenerateRequest(model="tiny", prompt="x",
                                         sampling=common_pb2.SamplingParams(max_tokens=1))

    def send() -> float:
        t0 = time.perf_counter()
        for _ in stub.Generate(request, timeout=5):
            pass
        return time.perf_counter() - t0

    return send


def main(num: int = 2000, warmup: int = 200) -> dict[str, object]:
    router, line = _spawn([sys.executable, "-c", _ROUTER])
    router_port = int(line)
    gateway, line = _spawn([sys.executable, "-m", "services.gateway", "--port", "0",
                            "--router", f"127.0.0.1:{router_port}"])
    match = re.search(r"listening on [\d.]+:(\d+) ", line)
    assert match, line
    port = int(match.group(1))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    paths = {
        "router_direct_grpc": _grpc(router_port),
        "gateway_completions_json": _http(port, "/v1/completions",
                                          {"model": "tiny", "prompt": "x", "max_tokens": 1}),
        "gateway_chat_json": _http(port, "/v1/chat/completions", chat),
        "gateway_chat_sse": _http(port, "/v1/chat/completions", {**chat, "stream": True}),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for i in range(warmup + num):
            for name, send in paths.items():
                elapsed = send()
                if i >= warmup:
                    times[name].append(elapsed)
    finally:
        for proc in (gateway, router):
            proc.terminate()
            proc.wait(10)
    base = statistics.median(times["router_direct_grpc"])
    out: dict[str, object] = {"bench": "gateway_added_latency", "requests": num}
    for name, xs in times.items():
        xs.sort()
        median = statistics.median(xs)
        out[name] = {"median_ms": round(median * 1e3, 3),
                     "p99_ms": round(xs[int(0.99 * (len(xs) - 1))] * 1e3, 3),
                     "added_median_ms": round((median - base) * 1e3, 3)}
    return out


if __name__ == "__main__":
    result = main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
    print(json.dumps(result))
    print(f"{'path':28s} {'median ms':>10s} {'p99 ms':>10s} {'added ms':>10s}")
    for key, row in result.items():
        if isinstance(row, dict):
            print(f"{key:28s} {row['median_ms']:10.3f} {row['p99_ms']:10.3f} "
                  f"{row['added_median_ms']:10.3f}")
