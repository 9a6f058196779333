"""Latency the gateway adds: client -> gateway -> router versus client -> router, on loopback.

Not a test (pytest does not collect it): run ``python tests/gateway/bench_gateway.py [N]``.
The scripted router (``fake_router``) and the real gateway (``python -m services.gateway``) run
as their own processes; requests go one at a time, each path in turn, so drift in the machine's
load hits every path alike. Also the handler's own cost: the ASGI app called in-process with a
router call that answers at once (no sockets, so far less noisy). Prints one JSON line, then a
table.
"""

from __future__ import annotations

import asyncio
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
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

from pdserve.proto.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402
from services.gateway.app import FastPath, create_app  # noqa: E402
from services.gateway.auth import CacheSalter, KeyStore  # noqa: E402
from services.gateway.config import GatewayConfig  # noqa: E402
from services.gateway.metrics import GatewayMetrics  # noqa: E402
from services.gateway.servicer import Gateway  # noqa: E402

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
        router.trace_ids.clear()

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


_REPLY = [router_pb2.GenerateResponse(placement=router_pb2.Placement(prompt_tokens=1)),
          router_pb2.GenerateResponse(token_ids=[5], text="hi",
                                      finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                      usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1))]


class _InstantCall:
    def __init__(self) -> None:
        self.i = 0

    async def read(self) -> Any:
        self.i += 1
        return _REPLY[self.i - 1] if self.i <= len(_REPLY) else grpc.aio.EOF

    def cancel(self) -> bool:
        return False


class _InstantRouter:
    address = "in-process"
    timeout = 600.0

    def generate(self, request: Any, metadata: Any = (), timeout: Any = None) -> _InstantCall:
        return _InstantCall()


async def _handler_us(path: str, body: dict[str, object], num: int) -> float:
    """Median microseconds of one request through the ASGI app, router answering at once."""
    gw = Gateway(GatewayConfig(port=0), _InstantRouter(), KeyStore(),  # type: ignore[arg-type]
                 GatewayMetrics(), CacheSalter("bench"))
    app = FastPath(create_app(gw), gw)
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    never = asyncio.Event()
    out = []
    for i in range(num + num // 10):
        messages = [{"type": "http.request", "body": raw, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive(messages: list[dict[str, Any]] = messages) -> dict[str, Any]:
            if messages:
                return messages.pop()
            await never.wait()
            raise AssertionError("unreachable")

        async def send(message: Any, sent: list[dict[str, Any]] = sent) -> None:
            sent.append(message)

        t0 = time.perf_counter()
        await app(dict(scope), receive, send)
        if i >= num // 10:
            out.append(time.perf_counter() - t0)
        assert sent[0]["status"] == 200, sent
    return round(statistics.median(out) * 1e6, 1)


def handler_costs(num: int) -> dict[str, float]:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    completion = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    cases = {"completions_json": ("/v1/completions", completion),
             "completions_sse": ("/v1/completions", {**completion, "stream": True}),
             "chat_json": ("/v1/chat/completions", chat),
             "chat_sse": ("/v1/chat/completions", {**chat, "stream": True})}
    return {f"handler_{name}_us": asyncio.run(_handler_us(path, body, num))
            for name, (path, body) in cases.items()}


if __name__ == "__main__":
    num = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    result = main(num)
    result.update(handler_costs(5 * num))
    print(json.dumps(result))
    print(f"{'path':28s} {'median ms':>10s} {'p99 ms':>10s} {'added ms':>10s}")
    for key, row in result.items():
        if isinstance(row, dict):
            print(f"{key:28s} {row['median_ms']:10.3f} {row['p99_ms']:10.3f} "
                  f"{row['added_median_ms']:10.3f}")
    for key, value in result.items():
        if key.startswith("handler_"):
            print(f"{key:28s} {value:10.1f} us (in-process, router answering at once)")
