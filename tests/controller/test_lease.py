"""Leader election with a real (private) Redis: one of two contenders leads; when the leader
dies (stops renewing) the other takes over within the lease time; a clean stop hands over."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from pdserve.controller.lease import RedisLease

KEY = "pdserve-test-15:controller-lease"
TTL_MS = 600


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.delete(KEY)
    await c.aclose()


async def _wait_leader(lease: RedisLease, within_s: float) -> float:
    t0 = time.monotonic()
    async with asyncio.timeout(within_s):
        while not lease.is_leader:
            await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def test_one_leads_and_the_other_takes_over_when_it_dies(client: aioredis.Redis) -> None:
    a = RedisLease(client, KEY, "router-a", TTL_MS)
    b = RedisLease(client, KEY, "router-b", TTL_MS)
    a.start()
    await _wait_leader(a, 2)
    b.start()
    await asyncio.sleep(TTL_MS * 2 / 1000)  # several renewals: a keeps it, b never gets it
    assert a.is_leader and not b.is_leader
    assert await client.get(KEY) == b"router-a"
    await a.stop(release=False)  # a dies: no release, no more renewals
    took = await _wait_leader(b, 3)
    assert took <= TTL_MS / 1000 + TTL_MS / 3000 + 0.3  # lease expiry + one acquire interval
    assert await client.get(KEY) == b"router-b"
    assert not await a.try_acquire()  # the old leader cannot take it back while b renews
    await b.stop()


async def test_a_clean_stop_releases_at_once_and_renew_checks_the_holder(
        client: aioredis.Redis) -> None:
    a = RedisLease(client, KEY, "router-a", 60_000)
    b = RedisLease(client, KEY, "router-b", 60_000)
    assert await a.try_acquire() and not await b.try_acquire()
    await client.set(KEY, "someone-else", px=60_000)  # a's lease was lost and taken
    assert not await a.try_acquire()  # renew sees another holder: a stops leading
    await client.set(KEY, "router-a", px=60_000)
    a.is_leader = True
    await a.stop(release=True)
    assert await client.get(KEY) is None
    assert await b.try_acquire()
    await b.stop()


def test_bad_arguments_are_named() -> None:
    class Dummy:
        def register_script(self, _: str) -> None:
            return None

    with pytest.raises(ValueError, match="ttl_ms must be >= 30"):
        RedisLease(Dummy(), KEY, "a", 10)
    with pytest.raises(ValueError, match="holder must name this contender"):
        RedisLease(Dummy(), KEY, "", 1000)
