"""``pdserve bench router``: the latency the router (and gateway + router) adds to a request.

Instant engines (real gRPC servers that answer at once: a prefill returning a first token, a
decode streaming ``--tokens`` chunks) run in one child process; the real router
(``python -m services.router``) and, when it starts, the real gateway run as their own
processes. The client sends the same token-id prompt, in turns, straight to the engines
(Prefill then Decode, as the router does), through the router, and through gateway + router;
the added latency is each path's median / P99 minus the direct one. Then ``--concurrency``
clients send as fast as they can through the router for ``--seconds``: routed requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from pdserve.env import LOG_LEVEL_VAR
from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"listening on ([\w.\[\]:-]+):(\d+)")


def _spawn(argv: list[str], log: Path, timeout: float = 60.0) -> tuple[subprocess.Popen[str], str]:
    """Start a child; return it and its ready line (stdout), or raise with its log tail."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'libs'}",
           LOG_LEVEL_VAR: "warning"}
    with log.open("w") as err:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening on" in line:
            return proc, line
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{argv[2]} did not start: {log.read_text()[-2000:]}")


def _start_redis(sock: Path, log: Path) -> subprocess.Popen[str]:
    """A private redis-server on a unix socket only (no TCP port to collide with)."""
    with log.open("w") as out:
        proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock),
                                 "--save", "", "--appendonly", "no"],
                                stdout=out, stderr=out, text=True)
    deadline = time.monotonic() + 10
    while not sock.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"redis-server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.02)
    return proc


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Paths:
    """One way to send the same request: straight to the engines, via router, via gateway."""

    def __init__(self, engines: tuple[str, str], router: str, gateway: str | None,
                 prompt: list[int], num_tokens: int) -> None:
        self.prefill = engine_pb2_grpc.PrefillStub(grpc.aio.insecure_channel(engines[0]))
        self.decode = engine_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(engines[1]))
        self.router = router_pb2_grpc.RouterStub(grpc.aio.insecure_channel(router))
        self.prompt, self.num_tokens = prompt, num_tokens
        self.sampling = common_pb2.SamplingParams(max_tokens=num_tokens + 1, temperature=0.0)
        self.http: Any = None
        self.gateway_url = f"http://{gateway}/v1/completions" if gateway else None
        if gateway:
            import httpx

            self.http = httpx.AsyncClient(timeout=10.0)

    async def direct(self) -> None:
        meta = common_pb2.RequestMeta(request_id=os.urandom(8).hex())
        first = await self.prefill.Prefill(engine_pb2.PrefillRequest(
            meta=meta, prompt_token_ids=self.prompt, sampling=self.sampling), timeout=10)
        request = engine_pb2.DecodeRequest(meta=meta, prompt_token_ids=self.prompt,
                                           sampling=self.sampling,
                                           first_token_id=first.first_token_id)
        async for _ in self.decode.Decode(request, timeout=10):
            pass

    async def via_router(self) -> None:
        request = router_pb2.GenerateRequest(model="tiny", sampling=self.sampling)
        request.prompt_token_ids.ids.extend(self.prompt)
        async for _ in self.router.Generate(request, timeout=10):
            pass

    async def via_gateway(self) -> None:
        body = {"model": "tiny", "prompt": self.prompt, "max_tokens": self.num_tokens + 1,
                "temperature": 0}
        response = await self.http.post(self.gateway_url, json=body)
        response.raise_for_status()


async def _latencies(paths: dict[str, Callable[[], Awaitable[None]]], num: int,
                     warmup: int) -> dict[str, list[float]]:
    """Each path in turn per request, so drift and noise hit every path alike."""
    out: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(warmup + num):
        for name, send in paths.items():
            t0 = time.perf_counter()
            await send()
            if i >= warmup:
                out[name].append(time.perf_counter() - t0)
    return out


async def _throughput(send: Callable[[], Awaitable[None]], concurrency: int,
                      seconds: float) -> float:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await send()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


def _table(result: dict[str, Any]) -> str:
    lines = [f"{'path':<17}{'median ms':>11}{'p99 ms':>10}{'added median':>14}{'added p99':>11}"]
    for name, row in result["paths"].items():
        lines.append(f"{name:<17}{row['median_ms']:>11.3f}{row['p99_ms']:>10.3f}"
                     f"{row['added_median_ms']:>14.3f}{row['added_p99_ms']:>11.3f}")
    lines.append(f"routed requests/s (concurrency {result['concurrency']}): "
                 f"{result['router_rps']:.0f}   direct: {result['direct_rps']:.0f}")
    lines.append(f"router's own work (router - bare grpc relay, median): "
                 f"{result['router_over_bare_relay_median_ms']:.3f} ms; "
                 f"1-min load average {result['load_average_1m']:.1f} on {result['cpus']} CPUs")
    lines.append(f"target: added median through the router < 1 ms -> "
                 f"{'met' if result['target_met'] else 'NOT met'}")
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench router", description=__doc__)
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    parser.add_argument("--requests", type=int, default=400, help="timed requests per path")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=4, help="decode chunks per request")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0, help="throughput phase length")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--no-gateway", action="store_true")
    parser.add_argument("--no-index", action="store_true",
                        help="router without Redis (no index round trip), to price that trip")
    args = parser.parse_args(argv)
    for name in ("requests", "tokens", "prompt_tokens", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import tempfile

    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-router-"))
    children: list[subprocess.Popen[str]] = []
    try:
        result = _run(args, logs, children)
    except RuntimeError as exc:
        sys.stderr.write(f"pdserve bench router: error: {exc}\n")
        return 1
    finally:
        for child in reversed(children):
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
    print(_table(result))
    if args.json:
        print(json.dumps(result))
    return 0


def _run(args: argparse.Namespace, logs: Path,
         children: list[subprocess.Popen[str]]) -> dict[str, Any]:
    py = sys.executable
    proc, line = _spawn([py, "-m", "pdserve_bench.router_servers", "engines", str(args.tokens)],
                        logs / "engines.log")
    children.append(proc)
    engines = tuple(line.split("listening on ")[1].split())
    router_argv = [py, "-m", "services.router", "--port", "0", "--model", "tiny",
                   "--policy", args.policy, "--prefill", engines[0], "--decode", engines[1]]
    redis_note = "no redis-server on PATH: no index lookup"
    if args.no_index:
        redis_note = "--no-index: no index lookup"
    elif shutil.which("redis-server"):
        children.append(_start_redis(logs / "redis.sock", logs / "redis.log"))
        router_argv += ["--redis-url", f"unix://{logs / 'redis.sock'}"]
        redis_note = "private redis-server (unix socket)"
    proc, line = _spawn([py, "-m", "pdserve_bench.router_servers", "relay", *engines],
                        logs / "relay.log")
    children.append(proc)
    relay = line.split("listening on ")[1].strip()
    proc, line = _spawn(router_argv, logs / "router.log")
    children.append(proc)
    match = READY.search(line)
    assert match is not None
    router = f"127.0.0.1:{match.group(2)}"
    gateway = None
    if not args.no_gateway:
        try:
            proc, line = _spawn([py, "-m", "services.gateway", "--port", "0", "--grpc-port",
                                 "0", "--router", router], logs / "gateway.log")
            children.append(proc)
            match = READY.search(line)
            gateway = f"127.0.0.1:{match.group(2)}" if match else None
        except RuntimeError as exc:
            sys.stderr.write(f"gateway skipped: {exc}\n")
    return asyncio.run(_measure(args, engines, relay, router, gateway, redis_note))


async def _measure(args: argparse.Namespace, engines: tuple[str, ...], relay: str, router: str,
                   gateway: str | None, redis_note: str) -> dict[str, Any]:
    prompt = [(7 * i) % 500 + 2 for i in range(args.prompt_tokens)]
    paths = Paths((engines[0], engines[1]), router, gateway, prompt, args.tokens)
    bare = Paths((engines[0], engines[1]), relay, None, prompt, args.tokens)
    sends: dict[str, Callable[[], Awaitable[None]]] = {
        "direct": paths.direct, "bare grpc relay": bare.via_router, "router": paths.via_router}
    if gateway:
        sends["gateway+router"] = paths.via_gateway
    lat = await _latencies(sends, args.requests, args.warmup)
    base_med, base_p99 = statistics.median(lat["direct"]), _percentile(lat["direct"], 0.99)
    rows = {}
    for name, values in lat.items():
        med, p99 = statistics.median(values), _percentile(values, 0.99)
        rows[name] = {"median_ms": med * 1e3, "p99_ms": p99 * 1e3,
                      "added_median_ms": (med - base_med) * 1e3,
                      "added_p99_ms": (p99 - base_p99) * 1e3}
    router_rps = await _throughput(paths.via_router, args.concurrency, args.seconds)
    direct_rps = await _throughput(paths.direct, args.concurrency, args.seconds)
    return {"bench": "router", "requests": args.requests, "prompt_tokens": args.prompt_tokens,
            "decode_chunks": args.tokens, "policy": args.policy, "index": redis_note,
            "gateway": gateway is not None, "concurrency": args.concurrency,
            "paths": rows, "router_rps": router_rps, "direct_rps": direct_rps,
            "router_over_bare_relay_median_ms":
                rows["router"]["median_ms"] - rows["bare grpc relay"]["median_ms"],
            "target_met": rows["router"]["added_median_ms"] < 1.0, "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0]}


if __name__ == "__main__":
    sys.exit(main())
