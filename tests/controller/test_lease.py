"""Leader election with a real (private) Redis: one of two contenders leads; when the leader
dies (stops renewing) the other takes over within the lease time; a clean stop hands over; a
Redis that does not answer ends the lead within the lease time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from pdserve.controller.lease import RedisLease

KEY = "pdserve-test-15:controller-lease"
TTL_MS = 600


@pytest.fixture
async def clients(redis_url: str) -> AsyncIterator[list[aioredis.Redis]]:
    """One client per contender, as each router has its own (with the router's socket timeout),
    and one for the test's own reads."""
    cs = [aioredis.Redis.from_url(redis_url, socket_timeout=2.0) for _ in range(3)]
    yield cs
    await cs[2].delete(KEY)
    for c in cs:
        await c.aclose()


async def _wait_leader(lease: RedisLease, within_s: float) -> float:
    """Seconds until ``lease`` leads; fails (it does not hang) when it does not within_s."""
    t0 = time.monotonic()
    while not lease.is_leader:
        if time.monotonic() - t0 > within_s:
            pytest.fail(f"{lease.holder} did not lead within {within_s} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def test_one_leads_and_the_other_takes_over_when_it_dies(
        clients: list[aioredis.Redis]) -> None:
    a = RedisLease(clients[0], KEY, "router-a", TTL_MS)
    b = RedisLease(clients[1], KEY, "router-b", TTL_MS)
    try:
        a.start()
        await _wait_leader(a, 2)
        b.start()
        await asyncio.sleep(TTL_MS * 2 / 1000)  # several renewals: a keeps it, b never gets it
        assert a.is_leader and not b.is_leader
        assert await clients[2].get(KEY) == b"router-a"
        await a.stop(release=False)  # a dies: no release, no more renewals
        took = await _wait_leader(b, 3)
        assert took <= TTL_MS / 1000 + TTL_MS / 3000 + 0.3  # lease expiry + one acquire interval
        assert await clients[2].get(KEY) == b"router-b"
        assert not await a.try_acquire()  # the old leader cannot take it back while b renews
    finally:
        await a.stop(release=False)
        await b.stop()


async def test_a_clean_stop_releases_at_once_and_renew_checks_the_holder(
        clients: list[aioredis.Redis]) -> None:
    a = RedisLease(clients[0], KEY, "router-a", 60_000)
    b = RedisLease(clients[1], KEY, "router-b", 60_000)
    assert await a.try_acquire() and not await b.try_acquire()
    await clients[2].set(KEY, "someone-else", px=60_000)  # a's lease was lost and taken
    assert not await a.try_acquire()  # renew sees another holder: a stops leading
    await clients[2].set(KEY, "router-a", px=60_000)
    a.is_leader = True
    await a.stop(release=True)
    assert await clients[2].get(KEY) is None
    assert await b.try_acquire()
    await b.stop()


class _Unanswering:
    """A Redis client whose commands are sent and never answered (a hung server, a lost link)."""

    def register_script(self, _: str) -> Any:
        return self._never

    async def set(self, *_: Any, **__: Any) -> bool:
        return await self._never()

    async def _never(self, *_: Any, **__: Any) -> Any:
        await asyncio.Event().wait()


async def test_a_redis_that_does_not_answer_ends_the_lead_within_the_lease() -> None:
    lease = RedisLease(_Unanswering(), KEY, "router-a", 100)
    lease.is_leader = True  # it led; now its renew gets no answer
    t0 = time.monotonic()
    assert not await asyncio.wait_for(lease.try_acquire(), 2)
    assert time.monotonic() - t0 < 0.5
    assert not await asyncio.wait_for(lease.try_acquire(), 2)  # nor does an acquire hang
    lease.is_leader = True
    await asyncio.wait_for(lease.stop(release=True), 1)  # a stop does not hang on the release


def test_bad_arguments_are_named() -> None:
    class Dummy:
        def register_script(self, _: str) -> None:
            return None

    with pytest.raises(ValueError, match="ttl_ms must be >= 30"):
        RedisLease(Dummy(), KEY, "a", 10)
    with pytest.raises(ValueError, match="holder must name this contender"):
        RedisLease(Dummy(), KEY, "", 1000)
