"""Leader election over a Redis lease: among several routers sharing Redis, one controller acts.

    acquire   SET key holder NX PX ttl          (only when nobody holds it)
    renew     Lua: if GET key == holder then PEXPIRE key ttl   (check-and-extend, atomic)
    release   Lua: if GET key == holder then DEL key           (on a clean stop)

A leader that dies stops renewing; its lease expires within ``ttl_ms`` and the next contender's
acquire (every ``ttl_ms / 3``) wins. A leader that fails to renew stops acting at once; so does
one whose renew has no answer within ``ttl_ms`` (by then the lease may be another's), whatever
timeouts the client it was given has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import redis.exceptions

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisLease:
    """One contender for ``key`` (a ``redis.asyncio`` client is passed in, not opened here)."""

    def __init__(self, client: Any, key: str, holder: str, ttl_ms: int = 5000) -> None:
        if ttl_ms < 30:
            raise ValueError(f"ttl_ms must be >= 30, got {ttl_ms}")
        if not holder:
            raise ValueError("holder must name this contender")
        self.client, self.key, self.holder, self.ttl_ms = client, key, holder, ttl_ms
        self.is_leader = False
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._task: asyncio.Task[None] | None = None

    async def try_acquire(self) -> bool:
        """Acquire if free, renew if ours; the answer is whether we lead now."""
        try:
            async with asyncio.timeout(self.ttl_ms / 1000):
                if self.is_leader:
                    self.is_leader = bool(await self._renew(keys=[self.key],
                                                            args=[self.holder, self.ttl_ms]))
                else:
                    self.is_leader = bool(await self.client.set(self.key, self.holder, nx=True,
                                                                px=self.ttl_ms))
        except (redis.exceptions.RedisError, TimeoutError) as exc:
            log.warning("lease: redis error, not leading",
                        extra={"fields": {"error": str(exc) or type(exc).__name__}})
            self.is_leader = False
        return self.is_leader

    async def _run(self) -> None:
        while True:
            was = self.is_leader
            if await self.try_acquire() != was:
                log.info("lease changed", extra={"fields": {
                    "key": self.key, "holder": self.holder, "leader": self.is_leader}})
            await asyncio.sleep(self.ttl_ms / 3000)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self, release: bool = True) -> None:
        """Stop contending; ``release`` hands the lease over at once (a clean stop)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if release and self.is_leader:
            try:
                async with asyncio.timeout(self.ttl_ms / 1000):
                    await self._release(keys=[self.key], args=[self.holder])
            except (redis.exceptions.RedisError, TimeoutError) as exc:  # it expires by itself
                log.warning("lease: not released, it expires within ttl_ms",
                            extra={"fields": {"error": str(exc) or type(exc).__name__}})
        self.is_leader = False
