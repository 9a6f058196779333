"""``pdserve bench reload``: how long a hot reload (``Engine.LoadWeights``) pauses serving.

For each model, one engine on its step thread serves ``--streams`` greedy decode streams while
the weights swap ``--repeats`` times between two versions of the model (a built-in's seeds 0
and 1, or two checkpoint directories):

    load_ms       reading and preparing the new weights, off the step loop (serving goes on)
    swap_ms       the step loop stopped: the swap itself (median and max over the repeats)
    itl_ms        the streams' median inter-token gap, the yardstick for a pause
    max_gap_ms    the longest gap a stream saw across a swap under RELOAD_POLICY_REPREFILL
                  (the swap plus recomputing its sequence on the new weights)

The swap is measured on the engine thread (time.perf_counter around it); the gaps where the
tokens arrive, on the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import time
from typing import Any

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.engine.reload import ReloadPolicy, prepare_weights, swap_weights
from pdserve.sampling_params import SamplingParams


def versions(model: str, other: str) -> tuple[str, str]:
    from pdserve.models import builtin

    parsed = builtin.parse_builtin(model)
    if other:
        return model, other
    if parsed is None:
        raise SystemExit(f"pdserve bench reload: --other is needed for directory {model!r}")
    return f"{parsed[0]}@{parsed[1]}", f"{parsed[0]}@{parsed[1] + 1}"


async def _stream(aengine: AsyncEngine, rid: str, stamps: list[float]) -> None:
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    stream = await aengine.add_request(rid, [5, 9, 13, 17, 21, 25, 29, 33], params)
    async for out in stream:
        if out.new_token_ids:
            stamps.append(time.perf_counter())


async def bench_model(model: str, other: str, args: argparse.Namespace) -> dict[str, Any]:
    pair = versions(model, other)
    engine_args = EngineArgs(device=args.device, num_blocks=args.num_blocks,
                             max_model_len=4096)
    engine = Engine.from_model(pair[0], engine_args)
    aengine = AsyncEngine(engine)
    aengine.start()
    idle_swaps = []
    for i in range(args.repeats):  # idle: FINISH, nothing in flight
        lm = await asyncio.to_thread(prepare_weights, pair[(i + 1) % 2], engine)
        result = await aengine.call(functools.partial(swap_weights, lm=lm,
                                                      policy=ReloadPolicy.FINISH))
        idle_swaps.append(result.swap_s * 1e3)
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    tasks = [asyncio.create_task(_stream(aengine, f"s{k}", stamps[k]))
             for k in range(args.streams)]
    await asyncio.sleep(args.warmup)
    loads, busy_swaps, swap_at = [], [], []
    for i in range(args.repeats):
        start = time.perf_counter()
        lm = await asyncio.to_thread(prepare_weights, pair[i % 2], engine)
        loads.append((time.perf_counter() - start) * 1e3)
        swap_at.append(time.perf_counter())
        result = await aengine.call(functools.partial(swap_weights, lm=lm,
                                                      policy=ReloadPolicy.REPREFILL))
        busy_swaps.append(result.swap_s * 1e3)
        await asyncio.sleep(args.warmup)
    for rid in range(args.streams):
        await aengine.abort(f"s{rid}")
    await asyncio.gather(*tasks, return_exceptions=True)
    await aengine.close()
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False)]
    across = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False)
              if any(a <= t <= b for t in swap_at)]
    return {"model": model, "versions": list(pair), "device": args.device,
            "streams": args.streams, "repeats": args.repeats,
            "load_ms": statistics.median(loads),
            "swap_ms_idle": statistics.median(idle_swaps), "swap_ms_idle_max": max(idle_swaps),
            "swap_ms": statistics.median(busy_swaps), "swap_ms_max": max(busy_swaps),
            "itl_ms": statistics.median(gaps) * 1e3 if gaps else 0.0,
            "max_gap_ms": max(across) * 1e3 if across else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench reload", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bench-50m"],
                        help="built-ins (swapped between seed N and N+1) or a directory")
    parser.add_argument("--other", default="", help="the second version, for a directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds between swaps")
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.streams < 1 or args.repeats < 1:
        parser.error("--streams and --repeats must be >= 1")
    rows = [asyncio.run(bench_model(m, args.other, args)) for m in args.models]
    for row in rows:
        print(json.dumps(row))
    if not args.json:
        print(f"{'model':>12}{'load ms':>10}{'swap ms idle':>14}{'swap ms busy':>14}"
              f"{'(max)':>8}{'ITL ms':>9}{'max gap ms':>12}")
        for r in rows:
            print(f"{r['model']:>12}{r['load_ms']:>10.1f}{r['swap_ms_idle']:>14.2f}"
                  f"{r['swap_ms']:>14.2f}{r['swap_ms_max']:>8.2f}{r['itl_ms']:>9.1f}"
                  f"{r['max_gap_ms']:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
