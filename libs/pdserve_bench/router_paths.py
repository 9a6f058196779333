"""The ways ``pdserve bench router`` sends one request, and how it times them: in turns, one at a
time (each path's latency alone), and ``--concurrency`` clients at once, in rounds taking the
paths in turn (latency under load and requests/s)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable

import grpc

from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

Send = Callable[[], Awaitable[None]]


class Paths:
    """One request, sent straight to the engines, via a gRPC router, or via a gateway."""

    def __init__(self, engines: tuple[str, str], prompt: list[int], num_tokens: int) -> None:
        self.prefill = engine_pb2_grpc.PrefillStub(grpc.aio.insecure_channel(engines[0]))
        self.decode = engine_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(engines[1]))
        self.prompt, self.num_tokens = prompt, num_tokens
        self.sampling = common_pb2.SamplingParams(max_tokens=num_tokens + 1, temperature=0.0)

    async def direct(self) -> None:
        meta = common_pb2.RequestMeta(request_id=os.urandom(8).hex())
        first = await self.prefill.Prefill(engine_pb2.PrefillRequest(
            meta=meta, prompt_token_ids=self.prompt, sampling=self.sampling), timeout=10)
        request = engine_pb2.DecodeRequest(meta=meta, prompt_token_ids=self.prompt,
                                           sampling=self.sampling,
                                           first_token_id=first.first_token_id)
        async for _ in self.decode.Decode(request, timeout=10):
            pass

    def router(self, address: str) -> Send:
        stub = router_pb2_grpc.RouterStub(grpc.aio.insecure_channel(address))

        async def send() -> None:
            request = router_pb2.GenerateRequest(model="tiny", sampling=self.sampling)
            request.prompt_token_ids.ids.extend(self.prompt)
            async for _ in stub.Generate(request, timeout=10):
                pass

        return send

    def gateway(self, address: str) -> Send:
        body = json.dumps({"model": "tiny", "prompt": self.prompt,
                           "max_tokens": self.num_tokens + 1, "temperature": 0}).encode()
        return KeepAliveHttp(address, "/v1/completions", body).post


class KeepAliveHttp:
    """The least an HTTP/1.1 client can do: a pool of kept-alive connections, one request
    written in one piece, the answer read by its Content-Length. The bench's client shares
    its process with the gRPC paths' clients: a full HTTP client (httpx: ~1 ms a request)
    would time itself as much as the gateway."""

    def __init__(self, address: str, path: str, body: bytes) -> None:
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.request = (f"POST {path} HTTP/1.1\r\nhost: {address}\r\n"
                        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                        f"\r\n").encode() + body
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self) -> None:
        conn = self._idle.pop() if self._idle else await asyncio.open_connection(
            self.host, self.port)
        reader, writer = conn
        writer.write(self.request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        status = head[9:12]
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await reader.readexactly(length)
        if status != b"200":
            writer.close()
            raise RuntimeError(f"gateway answered {status.decode()}")
        self._idle.append(conn)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float], base: list[float]) -> dict[str, float]:
    """Median and P99 in ms, and what they add over ``base`` (the direct path's)."""
    med, p99 = statistics.median(values), percentile(values, 0.99)
    base_med, base_p99 = statistics.median(base), percentile(base, 0.99)
    return {"median_ms": med * 1e3, "p99_ms": p99 * 1e3,
            "added_median_ms": (med - base_med) * 1e3, "added_p99_ms": (p99 - base_p99) * 1e3}


async def in_turns(paths: dict[str, Send], num: int, warmup: int) -> dict[str, list[float]]:
    """Each path in turn per request, so drift and noise hit every path alike."""
    out: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(warmup + num):
        for name, send in paths.items():
            t0 = time.perf_counter()
            await send()
            if i >= warmup:
                out[name].append(time.perf_counter() - t0)
    return out


async def under_load(paths: dict[str, Send], concurrency: int, seconds: float,
                     round_seconds: float = 0.5) -> dict[str, tuple[list[float], float]]:
    """``concurrency`` clients sending back to back through each path, ``seconds`` in all,
    in rounds of ``round_seconds`` that take the paths in turn (so a burst of load from
    elsewhere on the machine hits every path alike): every request's latency, and requests/s."""
    num_rounds = max(1, round(seconds / round_seconds))
    out: dict[str, tuple[list[float], float]] = {name: ([], 0.0) for name in paths}
    for _ in range(num_rounds):
        for name, send in paths.items():
            latencies, elapsed = out[name]
            elapsed += await _round(send, concurrency, seconds / num_rounds, latencies)
            out[name] = (latencies, elapsed)
    return {name: (values, len(values) / elapsed) for name, (values, elapsed) in out.items()}


async def _round(send: Send, concurrency: int, seconds: float, latencies: list[float]) -> float:
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            await send()
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0
