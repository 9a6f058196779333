"""Units of the engine services: the throughput window, the engine thread under concurrent
adds/aborts and its inline calls, and registration in Redis."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import redis.asyncio as aioredis

from pdserve.engine.async_engine import AsyncEngine, ThroughputWindow
from pdserve.registry import list_instances
from pdserve.sampling_params import SamplingParams
from services.engine.config import EngineServiceConfig
from tests.services.harness import engine, serve


def test_throughput_window_keeps_only_recent_samples() -> None:
    w = ThroughputWindow(window_s=10.0)
    w.add(0.0, 0, 0)
    w.add(5.0, 500, 50)
    w.add(20.0, 600, 60)
    w.add(25.0, 1100, 110)
    prefill, decode = w.rates(25.0)
    # Steps ending in (15, 25]: 600 prefill and 60 decode tokens over the 10 s window.
    assert (round(prefill), round(decode)) == (60, 6)
    assert w.rates(100.0) == (0.0, 0.0)  # idle since: nothing recent
    fresh = ThroughputWindow(window_s=10.0)
    fresh.add(0.0, 0, 0)
    fresh.add(2.0, 100, 0)
    assert fresh.rates(2.0) == (50.0, 0.0)  # younger than the window: over its own age


async def test_engine_thread_serves_concurrent_adds_and_aborts() -> None:
    eng = engine()
    aeng = AsyncEngine(eng)
    aeng.start()
    try:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        streams = [await aeng.add_request(f"u{i}", [3 + i, 4, 5, 6], params) for i in range(6)]
        assert await aeng.abort("u0")

        async def drain(stream: object) -> tuple[int, str | None]:
            n, reason = 0, None
            async for out in stream:  # type: ignore[attr-defined]
                n += len(out.new_token_ids)
                reason = out.finish_reason
            return n, reason

        results = await asyncio.gather(*[drain(s) for s in streams])
        assert results[0][1] == "abort"
        assert all(r == (20, "length") for r in results[1:])
        assert aeng.num_streams == 0
        stats = await aeng.call(lambda e: e.stats())
        assert stats.num_blocks_used == 0
    finally:
        await aeng.close()
    eng.check_integrity()


async def test_an_inline_call_runs_at_once_on_a_parked_engine_and_never_beside_a_step(
        ) -> None:
    eng = engine("tiny", 64, "inline")
    aeng = AsyncEngine(eng)
    aeng.start()
    here = threading.get_ident()
    stepping = threading.Event()  # set while a step runs
    plain_step = eng.step

    def step() -> Any:
        stepping.set()
        try:
            return plain_step()
        finally:
            stepping.clear()

    eng.step = step  # type: ignore[method-assign]
    try:
        await asyncio.sleep(0.05)  # the engine thread parks: nothing to do
        where = await aeng.call(lambda e: threading.get_ident(), inline=True)
        assert where == here  # no hand-off to the engine thread and back
        assert await aeng.call(lambda e: threading.get_ident()) != here  # not asked: queued
        # Decoding: an inline call may run between two steps, never inside one.
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        stream = await aeng.add_request("busy", [3, 4, 5, 6], params)

        async def consume() -> list[Any]:
            return [o async for o in stream]

        done = asyncio.ensure_future(consume())
        seen = []
        while not done.done():
            seen.append(await aeng.call(lambda e: stepping.is_set(), inline=True))
            await asyncio.sleep(0.0005)  # let the steps run: calls land all through them
        await done
        assert len(seen) > 20 and not any(seen)
        assert aeng.num_streams == 0
    finally:
        await aeng.close()
    eng.check_integrity()


async def test_an_inline_call_keeps_its_place_behind_queued_commands() -> None:
    aeng = AsyncEngine(engine("tiny", 64, "inline-order"))
    aeng.start()
    order: list[str] = []
    try:
        await asyncio.sleep(0.05)  # parked
        aeng._commands.put(lambda: order.append("queued first"))  # noqa: SLF001 - not woken yet
        await aeng.call(lambda e: order.append("inline"), inline=True)
        assert order == ["queued first", "inline"]
    finally:
        await aeng.close()


async def test_an_inline_add_is_stepped_by_the_engine_thread() -> None:
    """A request added on the caller's thread still wakes the parked engine thread."""
    aeng = AsyncEngine(engine("tiny", 64, "inline-add"))
    aeng.start()
    try:
        await asyncio.sleep(0.05)
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        stream = await aeng.add_request("woken", [3, 4, 5, 6], params)
        async with asyncio.timeout(10):
            outs = [o async for o in stream]
        assert sum(len(o.new_token_ids) for o in outs) == 5
        assert outs[-1].finish_reason == "length"
    finally:
        await aeng.close()


async def test_colocated_instance_registers_and_deregisters(redis_url: str) -> None:
    config = EngineServiceConfig(role="colocated", num_blocks=64, redis_url=redis_url,
                                 instance_id="c7", registry_ttl=2.0)
    redis = aioredis.Redis.from_url(redis_url)
    try:
        async with serve(config, engine()) as client:
            for _ in range(50):
                records = await list_instances(redis)
                if records:
                    break
                await asyncio.sleep(0.02)
            assert len(records) == 1
            rec = records[0]
            assert (rec.instance_id, rec.role, rec.model, rec.block_size) == \
                ("c7", "colocated", "tiny", 16)
            assert rec.address == client.instance.address
            ttl = await redis.pttl("pdserve:instance:c7")
            assert 0 < ttl <= 2000
        assert await list_instances(redis) == []  # deregistered on stop
    finally:
        await redis.aclose()
