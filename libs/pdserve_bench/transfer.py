"""``pdserve bench transfer [--json] [--quick]``: KV transfer bandwidth, side by side in one run.

For batches of 1, 64 and 512 blocks of 1 MiB (16 layers x K,V x 16 tokens x 8 KV heads x 128
dims x 2 bytes), the same bytes moved by:
  (a) memcpy  -- one thread copying between two pre-faulted arrays in one call, best of the
                 repetitions (a ceiling), measured while the kvds are idle; the JSON also
                 has memcpy_blocks_gbps, the same bytes copied 1 MiB at a time;
  (b) kvd     -- kvd A -> kvd B, from Commit with push until every block is present at B;
  (c) grpc    -- a plain gRPC byte stream (1 MiB messages) between two processes;
  (d) e2e     -- the engine path: write slots on A (each block checksummed right after its
                 copy), Commit+push, Await on B, read; the Release is sent, and answered
                 off the clock, as a decode engine sends it.
(b) and (d) run on two pairs of real kvd processes: one pair takes the same-host path (the
receiver copies from the sender's mapped pool, the default), the other is held to UCX
(``--same-host false``; the ``_ucx`` columns). A gRPC sink process serves (c); all on
loopback. ``--quick`` uses batches of 1, 16 and 64 blocks and fewer repetitions.

Then one block through the engines' own code (``transfer_engines``): two real engines (the
``tiny`` built-in) and their kvd bridges over a same-host kvd pair, the prefill's export and
the decode's receive as the instances run them (the engine-thread copies included): the
``engines`` line of the text and the ``transfer_engines`` JSON line.

``--kv-dtypes`` instead moves SmolLM2-135M's block (30 layers, 3 KV heads, head_dim 64, 16
tokens: 737,280 bytes in float32, 368,640 in bfloat16, 195,840 in fp8/int8 with their scales)
in each KV cache dtype, 512 blocks (64 with ``--quick``) per Commit with push until present at
B, and reports blocks/s: what a decode receives per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import grpc
import numpy as np
import torch

from pdserve.kvd.client import KvdClient
from pdserve.kvd.layout import BlockLayout
from pdserve.proto.v1 import common_pb2
from pdserve_bench.transfer_engines import MODEL, engines_one_block
from pdserve_bench.transfer_kvds import (
    LAYOUT,
    MIB,
    KvdPair,
    close_all,
    kvd_pair,
    kvd_pairs,
    spawn,
)

_SINK = """
import asyncio, sys, grpc
async def sink(it, ctx):
    n = 0
    async for chunk in it:
        n += len(chunk)
    return n.to_bytes(8, "little")
async def main():
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    h = grpc.stream_unary_rpc_method_handler(sink)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("b.Sink", {"S": h})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


def bench_memcpy(n: int, reps: int, chunk: int = 0) -> float:
    """Best-of-reps GB/s of one thread copying ``n`` MiB, in one call or ``chunk``-byte calls.

    One call is the stricter ceiling: above ~3/4 of the L3 size glibc switches to
    non-temporal stores, so a single 512 MiB copy beats the same bytes copied block by block.
    """
    src = np.random.randint(0, 255, n * MIB, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    step = chunk or n * MIB
    times = []
    for _ in range(max(reps, 5)):
        t = time.perf_counter()
        for i in range(0, n * MIB, step):
            np.copyto(dst[i:i + step], src[i:i + step])
        times.append(time.perf_counter() - t)
    return n * MIB / min(times) / 1e9


async def bench_grpc(address: str, n: int, reps: int) -> float:
    chunk = os.urandom(MIB)
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.stream_unary("/b.Sink/S")
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            got = await call(iter([chunk] * n), timeout=120)
            times.append(time.perf_counter() - t)
            assert int.from_bytes(got, "little") == n * MIB
    return n * MIB / statistics.median(times) / 1e9


async def _run(sizes: list[int], quick: bool) -> list[dict[str, Any]]:
    procs, clients, pairs = await kvd_pairs(2 * max(sizes) + 64)
    sink, sink_port = spawn(["-c", _SINK])
    procs.append(sink)
    try:
        out = torch.empty(LAYOUT.shape, dtype=torch.bfloat16)
        rows = []
        for n in sizes:
            reps = 20 if n == 1 else (3 if quick or n >= 256 else 5)
            nbytes = n * MIB
            row: dict[str, Any] = {"batch_bytes": nbytes}
            kvds: dict[str, list[float]] = {path: [] for path in pairs}
            e2es: dict[str, list[float]] = {path: [] for path in pairs}
            for rep in range(reps):  # the paths in turns, the order reversed every other turn
                order = list(pairs.items())
                for path, pair in order if rep % 2 else order[::-1]:
                    kvds[path].append(await pair.kvd_once(n))
                    e2es[path].append(await pair.e2e_once(n, out))
            for path in pairs:
                kvd, e2e = kvds[path], e2es[path]
                sfx = {"same_host": "", "stream": "_stream", "ucx": "_ucx"}[path]
                row |= {f"kvd{sfx}_gbps": nbytes / statistics.median(kvd) / 1e9,
                        f"kvd{sfx}_best_gbps": nbytes / min(kvd) / 1e9,
                        f"e2e{sfx}_gbps": nbytes / statistics.median(e2e) / 1e9,
                        f"kvd{sfx}_latency_ms": statistics.median(kvd) * 1e3,
                        f"e2e{sfx}_latency_ms": statistics.median(e2e) * 1e3}
            # how each pair's engines' calls really travelled (a socket the client could not
            # open would have left it on the stream)
            row |= {f"control{sfx}": pair.a.control_carrier for sfx, pair in
                    (("", pairs["same_host"]), ("_stream", pairs["stream"]),
                     ("_ucx", pairs["ucx"]))}
            row |= {"memcpy_gbps": bench_memcpy(n, reps),
                    "memcpy_blocks_gbps": bench_memcpy(n, reps, MIB),
                    "grpc_gbps": await bench_grpc(f"127.0.0.1:{sink_port}", n, min(reps, 5))}
            rows.append(row)
        return rows
    finally:
        await close_all(procs, clients)


# -- --kv-dtypes: blocks/s per KV cache dtype ----------------------------------------------------

SHAPE = {"num_layers": 30, "block_size": 16, "num_kv_heads": 3, "head_dim": 64}
DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "int8")


async def _one_dtype(dtype: str, num_blocks: int, reps: int) -> dict[str, float | str]:
    layout = BlockLayout(**SHAPE, dtype=dtype)  # type: ignore[arg-type]
    capacity = math.ceil(2 * num_blocks * layout.block_bytes / MIB) + 16
    (pa, addr_a), (pb, addr_b) = kvd_pair(capacity)
    a, b = KvdClient(addr_a, "bench-a"), KvdClient(addr_b, "bench-b")
    try:
        await a.register(layout)
        await b.register(layout)
        pair = KvdPair(a, b, common_pb2.KvdEndpoint(node_id=addr_b, address=addr_b), layout)
        await pair.kvd_once(1)  # warm-up: endpoints, channels
        median = statistics.median([await pair.kvd_once(num_blocks) for _ in range(reps)])
        return {"kv_dtype": dtype, "block_bytes": layout.block_bytes,
                "num_blocks": num_blocks, "blocks_per_s": round(num_blocks / median),
                "gbps": round(num_blocks * layout.block_bytes / median / 1e9, 3)}
    finally:
        await a.close()
        await b.close()
        for p in (pa, pb):
            p.terminate()
            p.wait(timeout=30)


def main_kv_dtypes(as_json: bool, quick: bool) -> int:
    """``--kv-dtypes``: kvd A -> kvd B blocks/s of SmolLM2-sized blocks in each KV cache
    dtype (a kvd pool holds one dtype, so each gets its own pair of kvd processes, which
    accept each other as peers: push destinations must be registered nodes)."""
    num_blocks, reps = (64, 3) if quick else (512, 5)
    rows = [asyncio.run(_one_dtype(d, num_blocks, reps)) for d in DTYPES]
    print(f"{'kv dtype':>14} {'block bytes':>11} {'blocks':>6} {'blocks/s':>9} {'GB/s':>6}")
    for r in rows:
        print(f"{r['kv_dtype']:>14} {r['block_bytes']:>11} {r['num_blocks']:>6} "
              f"{r['blocks_per_s']:>9} {r['gbps']:>6}")
    print("(SmolLM2-135M blocks; kvd A -> kvd B, Commit with push until present at B; median)")
    if as_json:
        for r in rows:
            print(json.dumps({"bench": "transfer_kv_dtypes", **r}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="also print one JSON line per batch")
    ap.add_argument("--quick", action="store_true", help="batches of 1, 16, 64 MiB; fewer reps")
    ap.add_argument("--sizes", type=int, nargs="+", metavar="MIB",
                    help="batch sizes in MiB (default 1 64 512; --quick: 1 16 64)")
    ap.add_argument("--kv-dtypes", action="store_true",
                    help="instead: blocks/s of SmolLM2-sized blocks in each KV cache dtype")
    args = ap.parse_args(argv)
    if args.kv_dtypes:
        return main_kv_dtypes(args.json, args.quick)
    sizes = args.sizes or ([1, 16, 64] if args.quick else [1, 64, 512])
    if min(sizes) < 1:
        ap.error(f"--sizes: every batch is at least 1 MiB, got {min(sizes)}")
    # Engine-side block copies are 1 MiB each: intra-op threads only add contention (on a busy
    # 2-core host, 40x slower copies).
    torch.set_num_threads(1)
    rows = asyncio.run(_run(sizes, args.quick))
    engines = asyncio.run(engines_one_block(30 if args.quick else 100))
    cols = ("memcpy", "grpc", "kvd", "kvd_ucx", "e2e", "e2e_stream", "e2e_ucx")
    print(f"{'batch':>8} " + " ".join(f"{c:>10}" for c in cols)
          + f" {'kvd lat':>9} {'e2e lat':>9} {'stream lat':>10} {'e2e/memcpy':>10}"
          f" {'e2e/grpc':>8}")
    for r in rows:
        print(f"{r['batch_bytes'] // MIB:>5}MiB "
              + " ".join(f"{r[c + '_gbps']:>10.2f}" for c in cols)
              + f" {r['kvd_latency_ms']:>7.2f}ms {r['e2e_latency_ms']:>7.2f}ms"
              f" {r['e2e_stream_latency_ms']:>8.2f}ms"
              f" {r['e2e_gbps'] / r['memcpy_gbps']:>10.2f} {r['e2e_gbps'] / r['grpc_gbps']:>8.2f}")
    print("(GB/s, medians but memcpy = best; kvd = Commit with push until present at B; "
          "e2e = the engine path, write on A -> read on B, the engines' calls on the kvds' "
          "control sockets; e2e_stream = the same kvds, the calls on the gRPC Control stream; "
          "_ucx = kvds held to UCX)")
    print(f"engines: one {engines['engines_block_bytes'] // 1024} KiB block of the "
          f"{MODEL} model, prefill export -> decode receive: "
          f"{engines['engines_block_ms']:.2f} ms median (min "
          f"{engines['engines_block_min_ms']:.2f}; export {engines['engines_export_ms']:.2f}, "
          f"receive {engines['engines_receive_ms']:.2f}; {engines['engines_reps']} reps)")
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"bench": "transfer_engines", "model": MODEL, **engines}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
