"""An engine busy with a long step still answers Stats (the router's health poll) at once,
from the snapshot of its last step; idle, Stats counts everything queued before it."""

from __future__ import annotations

import asyncio
import time

from services.engine.admin import STATS_WAIT_S
from tests.services.harness import engine, serve
from tests.services.test_engine_services import colocated


async def test_stats_answers_while_the_engine_thread_is_busy() -> None:
    async with serve(colocated(), engine()) as client:
        before = await client.stats()
        busy = asyncio.create_task(client.instance.aengine.call(lambda e: time.sleep(3.0)))
        await asyncio.sleep(0.1)  # the engine thread is inside the "step" now
        start = time.monotonic()
        stats = await client.stats()
        assert time.monotonic() - start < STATS_WAIT_S + 0.75  # not the 3 s step
        assert stats.kv_blocks_free == before.kv_blocks_free
        assert not busy.done()
        await busy
