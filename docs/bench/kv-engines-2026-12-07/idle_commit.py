import asyncio, os, sys, time, statistics
sys.path[:0] = ["/work/main", "/work/main/libs"]
from pdserve_bench.transfer_kvds import kvd_pairs, close_all
from pdserve.proto.v1 import common_pb2
from pdserve.kvd.client import CommitEntry
import torch
torch.set_num_threads(1)
async def main():
    procs, clients, pairs = await kvd_pairs(256)
    p = pairs["same_host"]
    res = {}
    for gap in (0.0, 0.005, 0.0, 0.005):
        cs, al = [], []
        for i in range(150):
            hs = p.hashes(1)
            t0 = time.perf_counter(); pins = await p.a.allocate(1); t1 = time.perf_counter()
            sums = [p.a.write_block(x.slot, p.block) for x in pins]
            if gap: await asyncio.sleep(gap)
            t2 = time.perf_counter()
            await p.a.commit([CommitEntry(x, h, s) for x, h, s in zip(pins, hs, sums)], p.dest)
            t3 = time.perf_counter()
            got = await p.b.await_blocks([common_pb2.BlockRef(hash=h) for h in hs], timeout=60)
            await p.b.release([x.pin_id for x in got])
            await asyncio.sleep(0.005)  # idle before the next allocate, as after a prefill
            if i >= 20: cs.append((t3 - t2) * 1e3); al.append((t1 - t0) * 1e3)
        print(f"gap {gap*1e3:.0f} ms before the commit: allocate {statistics.median(al):.3f} ms, commit {statistics.median(cs):.3f} ms", flush=True)
    await close_all(procs, clients)
asyncio.run(main())
