"""``pdserve bench router``: the latency the router (and gateway + router) adds to a request.

Instant engines (real gRPC servers that answer at once: a prefill returning a first token, a
decode streaming ``--tokens`` chunks) run in one child process; the real router
(``python -m services.router``) and the real gateways run as their own processes. The gateway
rows (``GATEWAYS``) put its HTTP servers side by side: uvicorn's pure-Python h11 parser on
asyncio's loop, httptools on uvloop, each in front of the gRPC router and with the router
embedded in the gateway (``--router embedded``, the same router flags). The client sends the
same token-id prompt, in turns, straight to the engines (Prefill then Decode, as the router
does), through the router, and through each gateway: the added latency is each path's median /
P99 minus the direct one. Then ``--concurrency`` clients send as fast as they can through each
path for ``--seconds``: latency under load (added over direct under the same load) and
requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.env import LOG_LEVEL_VAR
from pdserve_bench.router_paths import Paths, Send, in_turns, summary, under_load

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"listening on ([\w.\[\]:-]+):(\d+)")
# The gateway rows: name -> (how it reaches the router, HTTP server, event loop). The first is
# the gateway as it ran before issue 16 (uvicorn's pure-Python h11 on asyncio's loop, a gRPC
# hop); granian (Rust HTTP) serves the same ASGI app (``services.gateway.on_granian``).
GATEWAYS = {
    "gateway+router (h11, asyncio)": ("grpc", "h11", "asyncio"),
    "gateway+router (httptools, uvloop)": ("grpc", "httptools", "uvloop"),
    "gateway, embedded router (h11, asyncio)": ("embedded", "h11", "asyncio"),
    "gateway, embedded router (httptools, uvloop)": ("embedded", "httptools", "uvloop"),
    "gateway, embedded router (granian, asyncio)": ("embedded", "granian", "asyncio"),
}
OPTIONAL = {"httptools": "pdserve[fast]", "uvloop": "pdserve[fast]", "granian": "granian"}


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


def _table(result: dict[str, Any]) -> str:
    width = max(len(name) for name in result["paths"]) + 2
    head = f"{'median ms':>11}{'p99 ms':>10}{'added median':>14}{'added p99':>11}"
    lines = [f"one at a time ({result['requests']} requests per path, in turns):",
             f"{'path':<{width}}{head}"]
    for name, row in result["paths"].items():
        lines.append(f"{name:<{width}}{_cells(row)}")
    lines += [f"concurrency {result['concurrency']} ({result['seconds']:g} s per path, in rounds "
              "of 0.5 s taking the paths in turn):",
              f"{'path':<{width}}{head}{'req/s':>9}"]
    for name, row in result["concurrent"].items():
        lines.append(f"{name:<{width}}{_cells(row)}{row['rps']:>9.0f}")
    hw = result["hardware"]
    lines.append(f"hardware: {hw['cpu']}, {hw['cores']} cores, AVX2 {hw.get('avx2')}, "
                 f"AVX-512F {hw['avx512f']}, AVX-512-BF16 {hw['avx512_bf16']}, AMX {hw['amx']}")
    lines.append(f"router's own work (router - bare grpc relay, median): "
                 f"{result['router_over_bare_relay_median_ms']:.3f} ms; "
                 f"1-min load average {result['load_average_1m']:.1f} on {result['cpus']} CPUs")
    for target in result["targets"]:
        lines.append(f"target: {target['what']} -> {target['path']}: "
                     f"{'met' if target['met'] else 'NOT met'}")
    for note in result["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _cells(row: dict[str, float]) -> str:
    return (f"{row['median_ms']:>11.3f}{row['p99_ms']:>10.3f}"
            f"{row['added_median_ms']:>14.3f}{row['added_p99_ms']:>11.3f}")


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
    gateways, notes = ({}, []) if args.no_gateway else _start_gateways(
        router, router_argv[3:], logs, children)
    return asyncio.run(_measure(args, engines, relay, router, gateways, redis_note, notes))


def _start_gateways(router: str, router_flags: list[str], logs: Path,
                    children: list[subprocess.Popen[str]]) -> tuple[dict[str, str], list[str]]:
    """Every ``GATEWAYS`` row whose modules are installed: name -> its address; and notes
    naming the rows left out."""
    gateways: dict[str, str] = {}
    notes: list[str] = []
    py = sys.executable
    for i, (name, (mode, server, loop)) in enumerate(GATEWAYS.items()):
        missing = [m for m in (server, loop) if m in OPTIONAL
                   and not importlib.util.find_spec(m)]
        if missing:
            notes.append(f"{name}: skipped, {' and '.join(missing)} not installed (pip "
                         f"install {' '.join(sorted({repr(OPTIONAL[m]) for m in missing}))})")
            continue
        upstream = (["--router", router] if mode == "grpc" else
                    ["--router", "embedded", "--router-flags", shlex.join(router_flags)])
        flags = ["--port", "0", "--grpc-port", "0", *upstream]
        argv = ([py, "-m", "services.gateway.on_granian", *flags]
                if server == "granian" else
                [py, "-m", "services.gateway", *flags, "--http", server, "--loop", loop])
        proc, line = _spawn(argv, logs / f"gateway-{i}.log")
        children.append(proc)
        match = READY.search(line)
        assert match is not None
        gateways[name] = f"127.0.0.1:{match.group(2)}"
    return gateways, notes


async def _measure(args: argparse.Namespace, engines: tuple[str, ...], relay: str, router: str,
                   gateways: dict[str, str], redis_note: str, notes: list[str]
                   ) -> dict[str, Any]:
    prompt = [(7 * i) % 500 + 2 for i in range(args.prompt_tokens)]
    paths = Paths((engines[0], engines[1]), prompt, args.tokens)
    sends: dict[str, Send] = {"direct": paths.direct, "bare grpc relay": paths.router(relay),
                              "router": paths.router(router)}
    sends.update({name: paths.gateway(address) for name, address in gateways.items()})
    lat = await in_turns(sends, args.requests, args.warmup)
    rows = {name: summary(values, lat["direct"]) for name, values in lat.items()}
    loaded = await under_load({k: v for k, v in sends.items() if k != "bare grpc relay"},
                              args.concurrency, args.seconds)
    loaded_rows = {name: {**summary(values, loaded["direct"][0]), "rps": rps}
                   for name, (values, rps) in loaded.items()}
    return {"bench": "router", "requests": args.requests, "prompt_tokens": args.prompt_tokens,
            "decode_chunks": args.tokens, "policy": args.policy, "index": redis_note,
            "gateway": bool(gateways), "concurrency": args.concurrency,
            "seconds": args.seconds, "paths": rows, "concurrent": loaded_rows,
            "router_rps": loaded_rows["router"]["rps"],
            "direct_rps": loaded_rows["direct"]["rps"],
            "router_over_bare_relay_median_ms":
                rows["router"]["median_ms"] - rows["bare grpc relay"]["median_ms"],
            "targets": _targets(rows, loaded_rows, args.concurrency), "notes": notes,
            "hardware": _hardware(), "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0]}


def _hardware() -> dict[str, Any]:
    """The CPU and its flags (no matrix math runs here: they are reported, not used)."""
    from pdserve_bench.cluster_bench import hardware

    return {k: v for k, v in hardware().items() if k != "link"}


def _targets(rows: dict[str, dict[str, float]], loaded: dict[str, dict[str, float]],
             concurrency: int) -> list[dict[str, Any]]:
    """Issue 16's: the gRPC router alone < 1.5 ms added median; gateway + router < 2 ms added
    median and < 5 ms added P99 under load (judged on the best gateway row)."""
    out: list[dict[str, Any]] = [{"what": "router added median < 1.5 ms (one at a time)",
                                  "path": "router",
                                  "met": rows["router"]["added_median_ms"] < 1.5}]
    gateways = [name for name in loaded if name in GATEWAYS]
    if gateways:
        best = min(gateways, key=lambda name: loaded[name]["added_median_ms"])
        row = loaded[best]
        out.append({"what": f"gateway + router added median < 2 ms and P99 < 5 ms at "
                            f"concurrency {concurrency}", "path": best,
                    "met": row["added_median_ms"] < 2.0 and row["added_p99_ms"] < 5.0})
    return out


if __name__ == "__main__":
    sys.exit(main())
