"""``pdserve bench transfer --kv-dtypes``: kvd A -> kvd B blocks/s of one model's block in each
KV cache dtype (a kvd pool holds one dtype, so each gets its own pair of kvd processes).

The block is SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64, 16 tokens): 737,280 bytes in
float32, 368,640 in bfloat16, 195,840 in fp8/int8 (1-byte values plus a float32 scale per token
and head). Each dtype moves the same number of blocks (Commit with push until present at B,
median of the repetitions), so blocks/s compares what a decode receives per second.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
import subprocess

from pdserve.kvd.client import KvdClient
from pdserve.kvd.layout import BlockLayout
from pdserve.proto.v1 import common_pb2
from pdserve_bench.transfer import MIB, KvdPair, _spawn

SHAPE = {"num_layers": 30, "block_size": 16, "num_kv_heads": 3, "head_dim": 64}
DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "int8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kvd(capacity_mib: int, port: int, peer: str) -> tuple[subprocess.Popen[str], str]:
    """A kvd on ``port`` that accepts ``peer`` as a kvd node (push destinations and Transfer
    callers must be registered: no Redis registry here)."""
    proc, line = _spawn(["-m", "services.kvd", "--port", str(port), "--capacity-mib",
                         str(capacity_mib), "--peers", peer])
    if "listening on" not in line:
        raise RuntimeError(f"kvd did not start: {line!r}")
    return proc, line.split("listening on ")[1].split()[0]


async def _one(dtype: str, num_blocks: int, reps: int) -> dict[str, float | str]:
    layout = BlockLayout(**SHAPE, dtype=dtype)  # type: ignore[arg-type]
    capacity = math.ceil(2 * num_blocks * layout.block_bytes / MIB) + 16
    ports = _free_port(), _free_port()
    pa, addr_a = _kvd(capacity, ports[0], f"127.0.0.1:{ports[1]}")
    pb, addr_b = _kvd(capacity, ports[1], f"127.0.0.1:{ports[0]}")
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


def main(as_json: bool, quick: bool) -> int:
    num_blocks, reps = (64, 3) if quick else (512, 5)
    rows = [asyncio.run(_one(d, num_blocks, reps)) for d in DTYPES]
    print(f"{'kv dtype':>14} {'block bytes':>11} {'blocks':>6} {'blocks/s':>9} {'GB/s':>6}")
    for r in rows:
        print(f"{r['kv_dtype']:>14} {r['block_bytes']:>11} {r['num_blocks']:>6} "
              f"{r['blocks_per_s']:>9} {r['gbps']:>6}")
    print("(SmolLM2-135M blocks; kvd A -> kvd B, Commit with push until present at B; median)")
    if as_json:
        for r in rows:
            print(json.dumps({"bench": "transfer_kv_dtypes", **r}))
    return 0
