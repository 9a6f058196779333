"""One block through the engines' own code, for ``pdserve bench transfer``: the hand-over as a
prefill and a decode instance run it (``KvBridge.export`` and ``KvBridge.receive``), not the
kvd client calls alone. Two real engines (the ``tiny`` built-in) in this process, each with
its own engine thread and bridge, over a pair of same-host kvd processes.

Per repetition, untimed: the prefill engine computes a fresh one-block prompt (so every block
is new to both kvds). Timed: ``export`` on A (Allocate; the copy out of the engine's page on its
engine thread; the checksum; Commit with push to B's kvd) and ``receive`` on B (Await; the copy
into a page on B's engine thread; the Release, which the decode sends without waiting for its
answer). The JSON's ``engines_*`` fields; ``engines_block_bytes`` is the tiny model's block.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.kvd.bridge import KvBridge
from pdserve.kvd.client import KvdClient
from pdserve.proto.v1 import common_pb2
from pdserve.sampling_params import SamplingParams
from pdserve_bench.transfer_kvds import kvd_pair

MODEL = "tiny"


async def engines_one_block(reps: int) -> dict[str, Any]:
    (pa, addr_a), (pb, addr_b) = kvd_pair(64)
    engines = [AsyncEngine(Engine.from_model(MODEL, EngineArgs(num_blocks=256)))
               for _ in range(2)]
    bridges: list[KvBridge] = []
    try:
        for eng, addr, name in zip(engines, (addr_a, addr_b), ("bench-prefill", "bench-decode"),
                                   strict=True):
            eng.start()
            bridges.append(KvBridge(eng, KvdClient(addr, name), addr))
            await bridges[-1].register()
        return await _measure(engines[0], bridges[0], bridges[1], addr_b, reps)
    finally:
        for bridge in bridges:
            await bridge.drain()
            await bridge.client.close()
        for eng in engines:
            await eng.close()
        for proc in (pa, pb):
            proc.terminate()
            proc.wait(timeout=30)


async def _measure(prefill: AsyncEngine, out: KvBridge, into: KvBridge, addr_b: str,
                   reps: int) -> dict[str, Any]:
    dest = common_pb2.KvdEndpoint(node_id=addr_b, address=addr_b)
    block_size = prefill.engine.kv.block_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = prefill.engine.config.vocab_size
    export, receive, total = [], [], []
    warm = 5
    for i in range(warm + reps):
        rid = f"bench-block-{i}"
        prompt = [rng.randrange(2, vocab) for _ in range(block_size + 1)]
        stream = await prefill.add_request(rid, prompt, params, 0, "", prefill_only=True)
        final = None
        async for o in stream:
            final = o if o.finished else final
        assert final is not None and final.block_hashes and final.page_ids
        block = [(final.block_hashes[0], final.page_ids[0])]
        t0 = time.perf_counter()
        sent = await out.export(block, dest)
        t1 = time.perf_counter()
        await into.receive([common_pb2.BlockRef(hash=e.hash, checksum=e.checksum)
                            for e in sent], None, 30.0)
        t2 = time.perf_counter()
        await into.drain()  # the Release's answer, off the clock as the decode has it
        await prefill.release(rid)
        if i >= warm:
            export.append(t1 - t0)
            receive.append(t2 - t1)
            total.append(t2 - t0)
    assert out.client.layout is not None
    return {"engines_block_bytes": out.client.layout.block_bytes,
            "engines_block_ms": statistics.median(total) * 1e3,
            "engines_block_min_ms": min(total) * 1e3,
            "engines_export_ms": statistics.median(export) * 1e3,
            "engines_receive_ms": statistics.median(receive) * 1e3,
            "engines_reps": reps}
