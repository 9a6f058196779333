"""``pdserve bench burst``: a burst of requests at once against a small KV cache, beside the
same burst with ample KV — what overload costs when it queues instead of failing.

    pdserve bench burst                               # 64 requests, 32 vs 2048 KV blocks
    pdserve bench burst --requests 64 --small-blocks 32 --max-tokens 24 --json out.json

Each side starts its own ``pdserve up --prefill 1 --decode 1 --engine-arg=--num-blocks=N``
(every engine gets N blocks; the ~160-token prompts need 11 to start, 12 by their end)
(one after the other, never sharing the CPUs), sends every request at the same instant as a
stream, and measures each one's TTFT (first content chunk) and end-to-end time, and counts
answers by HTTP status (a 429 or 503 is a refused request). Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve_bench.cluster_bench import hardware
from pdserve_bench.stack import StackProcess
from pdserve_bench.stats import percentile


@dataclass
class BurstResult:
    side: str
    num_blocks: int
    num_requests: int
    statuses: dict[str, int] = field(default_factory=dict)
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    e2e_p99_s: float = 0.0
    wall_s: float = 0.0


def burst_prompt(i: int, repeats: int) -> str:
    """Request ``i``'s prompt: ~20 tokens a repeat (the tiny model's tokenizer), distinct per
    request (no shared prefix)."""
    return f"Request {i}: " + "tell me a long story about the sea and the ships. " * repeats


async def _one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, repeats: int,
               ) -> tuple[str, float | None, float]:
    """(outcome, TTFT, end to end): the HTTP status, or ``200+<code>`` for a stream that
    started and then ended in an error event."""
    start = time.perf_counter()
    ttft = None
    outcome = ""
    body = {"prompt": burst_prompt(i, repeats), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with client.stream("POST", f"{url}/completions", json=body) as response:
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"text":"' in line:
                ttft = time.perf_counter() - start
            if line.startswith('data: {"error"'):
                outcome = "+" + str(json.loads(line[6:])["error"].get("code"))
        return f"{response.status_code}{outcome}", ttft, time.perf_counter() - start


async def _burst(url: str, args: argparse.Namespace,
                 ) -> tuple[list[tuple[str, float | None, float]], float]:
    limits = httpx.Limits(max_connections=args.requests + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _one(client, url, -1, 4, 1)  # warm up: the first request loads lazy paths
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, i, args.max_tokens, args.repeats)
                                         for i in range(args.requests)))
        return list(results), time.perf_counter() - start


def run_side(side: str, num_blocks: int, args: argparse.Namespace, log_dir: Path) -> BurstResult:
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--prefill", "1",
            "--decode", "1", f"--engine-arg=--num-blocks={num_blocks}"]
    print(f"== {side}: {' '.join(argv[2:])}", file=sys.stderr, flush=True)
    with StackProcess(side, argv, env={}, log_path=log_dir / f"{side}.log",
                      ready_timeout_s=300) as info:
        results, wall = asyncio.run(_burst(info.base_url, args))
    ttfts = [t for code, t, _ in results if code == "200" and t is not None]
    e2e = [e for code, _, e in results if code == "200"]
    return BurstResult(
        side, num_blocks, args.requests,
        dict(Counter(code for code, _, _ in results)),
        percentile(ttfts, 50) if ttfts else float("nan"),
        percentile(ttfts, 99) if ttfts else float("nan"),
        percentile(e2e, 99) if e2e else float("nan"), wall)


def format_table(rows: list[BurstResult]) -> str:
    lines = [f"{'side':<8} {'blocks':>6} {'reqs':>5} {'outcomes':<14} {'TTFT p50':>9} "
             f"{'TTFT p99':>9} {'e2e p99':>8} {'wall':>7}"]
    for r in rows:
        statuses = ",".join(f"{k}:{v}" for k, v in sorted(r.statuses.items()))
        lines.append(f"{r.side:<8} {r.num_blocks:>6} {r.num_requests:>5} {statuses:<14} "
                     f"{r.ttft_p50_s:>8.2f}s {r.ttft_p99_s:>8.2f}s {r.e2e_p99_s:>7.2f}s "
                     f"{r.wall_s:>6.2f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench burst", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64, help="requests in the burst")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens each generates")
    parser.add_argument("--repeats", type=int, default=8,
                        help="prompt length: ~20 tokens a repeat (8: ~160 tokens, 11 blocks)")
    parser.add_argument("--only", choices=("small", "ample"), help="run one side only")
    parser.add_argument("--small-blocks", type=int, default=32,
                        help="decode KV blocks of the small side")
    parser.add_argument("--ample-blocks", type=int, default=2048,
                        help="decode KV blocks of the ample side")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-burst-") as logs:
        sides = {"small": args.small_blocks, "ample": args.ample_blocks}
        rows = [run_side(side, blocks, args, Path(logs)) for side, blocks in sides.items()
                if args.only in (None, side)]
    print(format_table(rows))
    out: dict[str, Any] = {"bench": "burst", "max_tokens": args.max_tokens,
                           "prompt_repeats": args.repeats,
                           "hardware": hardware(), "sides": [asdict(r) for r in rows]}
    print(json.dumps(out))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if all(set(r.statuses) == {"200"} for r in rows) else 1
