"""One block through the bridges, as the engines move it: prefill engine A exports one block
(allocate, copy out on the engine thread, commit with push to B's kvd); decode engine B receives
it (await, import on the engine thread, release). Real kvd processes, real engines (tiny)."""
import asyncio, os, sys, time, statistics, random
R = os.environ.get("ROOT", "/work/main"); sys.path[:0] = [R, R + "/libs"]
from pdserve_bench.transfer_kvds import kvd_pair
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import Engine
from pdserve.engine.config import EngineArgs
from pdserve.kvd.bridge import KvBridge
from pdserve.kvd.client import KvdClient
from pdserve.proto.v1 import common_pb2
from pdserve.sampling_params import SamplingParams

def engine():
    return Engine.from_model("tiny", EngineArgs(num_blocks=256, max_num_batched_tokens=256))

async def main():
    (pa, aa), (pb, ab) = kvd_pair(64)
    A, B = AsyncEngine(engine()), AsyncEngine(engine())
    A.start(); B.start()
    ba = KvBridge(A, KvdClient(aa, "eng-a"), aa); bb = KvBridge(B, KvdClient(ab, "eng-b"), ab)
    await ba.register(); await bb.register()
    dest = common_pb2.KvdEndpoint(node_id=ab, address=ab)
    bs = A.engine.kv.block_size
    rng = random.Random(1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ex, rc, tot = [], [], []
    al = []
    if os.environ.get("NOBARE"): al = [0.0]*40
    for i in range(0 if os.environ.get("NOBARE") else 300):
        t = time.perf_counter(); pins = await ba.client.allocate(1); al.append((time.perf_counter() - t) * 1e3)
        await ba.client.release([p.pin_id for p in pins])
    print("bare allocate median %.3f" % statistics.median(al[30:]))
    T = {}
    def timed(obj, name, key):
        f = getattr(obj, name)
        async def w(*a, **k):
            t = time.perf_counter()
            try: return await f(*a, **k)
            finally: T.setdefault(key, []).append((time.perf_counter() - t) * 1e3)
        setattr(obj, name, w)
    if os.environ.get("DETAIL"):
        timed(ba.client, "allocate", "a.allocate"); timed(ba.client, "commit", "a.commit")
        timed(A, "call", "a.engine_call"); timed(bb.client, "await_blocks", "b.await")
        timed(B, "call", "b.engine_call"); timed(bb.client, "release", "b.release")
    N = int(os.environ.get("N", "300"))
    for i in range(N):
        prompt = [rng.randrange(2, 200) for _ in range(bs + 1)]
        stream = await A.add_request(f"r{i}", prompt, params, 0, "", prefill_only=True)
        final = None
        async for out in stream:
            if out.finished: final = out
        blocks = list(zip(final.block_hashes, final.page_ids))[:1]
        if os.environ.get("SETTLE"): await asyncio.sleep(float(os.environ["SETTLE"]))
        t0 = time.perf_counter()
        got = await ba.export(blocks, dest)
        t1 = time.perf_counter()
        await bb.receive([common_pb2.BlockRef(hash=e.hash, checksum=e.checksum) for e in got], None, 10.0)
        t2 = time.perf_counter()
        if hasattr(bb, "drain"): await bb.drain()
        await A.release(f"r{i}")
        if i >= 30:
            ex.append((t1 - t0) * 1e3); rc.append((t2 - t1) * 1e3); tot.append((t2 - t0) * 1e3)
    for k, v in sorted(T.items()):
        v = v[30:]
        print(f"  {k:14s} median {statistics.median(v):.3f}  min {min(v):.3f}")
    for k, v in (("export", ex), ("receive", rc), ("total", tot)):
        print(f"{k:8s} median {statistics.median(v):.3f}  min {min(v):.3f}  p90 {sorted(v)[int(len(v)*.9)]:.3f}")
    await ba.client.close(); await bb.client.close()
    await A.close(); await B.close()
    for p in (pa, pb): p.terminate(); p.wait()

asyncio.run(main())
