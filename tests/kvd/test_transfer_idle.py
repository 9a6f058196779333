"""The data plane must go quiet between transfers: ucxx's blocking progress mode, left alone,
never re-arms its worker after the first event and spins its event loop at 100% CPU for the
life of the process (both kvds; on a 2-core host that halved every other process's speed)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from pdserve.kvd.client import CommitEntry
from tests.kvd.conftest import KvdProc
from tests.kvd.test_kvd_processes import Factory, client, endpoint, refs, start, write


def cpu_seconds(p: KvdProc) -> float:
    fields = Path(f"/proc/{p.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def test_kvds_idle_after_a_transfer(kvd_factory: Factory, redis_url: str) -> None:
    a, b = start(kvd_factory, redis_url), start(kvd_factory, redis_url)
    ca, cb = await client(a), await client(b)
    for _ in range(3):  # push (UCX events on both sides), then Await and release
        pins, hashes, sums = await write(ca, 8)
        await ca.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                        destination=endpoint(b))
        got = await cb.await_blocks(refs(hashes, sums), timeout=20)
        await cb.release([p.pin_id for p in got])
    await asyncio.sleep(0.3)  # let the transfers' pollers wind down
    before = [cpu_seconds(p) for p in (a, b)]
    await asyncio.sleep(1.5)
    used = [cpu_seconds(p) - t for p, t in zip((a, b), before, strict=True)]
    assert all(u < 0.3 for u in used), f"idle kvds used {used} CPU seconds in 1.5 s"
    await ca.close()
    await cb.close()
