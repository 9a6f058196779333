"""The router's side of the prefix index: one bounded lookup per request, and Redis outages.

While the index answers, ``lookup`` returns node -> leading blocks held. When a lookup fails
or is slower than ``timeout``, the index is marked unavailable (one log line, a gauge at 0) and
requests are routed by load only, without touching Redis again; ``probe`` (run by the router's
poll loop) tries a lookup and puts the index back when Redis answers. Redis is soft state: a
wrong or missing answer only costs a cache miss.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from redis.exceptions import RedisError

from pdserve.index.base import IndexUnavailable
from services.router import metrics

log = logging.getLogger(__name__)

_PROBE_HASH = bytes(32)  # never a real block hash: the probe is a genuine round trip


class PrefixLookup(Protocol):
    """The part of ``pdserve.index.PrefixIndex`` the router uses."""

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]: ...


class IndexClient:
    def __init__(self, index: PrefixLookup | None, timeout: float) -> None:
        self.index = index
        self.timeout = timeout
        self.is_available = index is not None
        metrics.INDEX_AVAILABLE.set(1 if self.is_available else 0)

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, int] | None:
        """Leading blocks of ``hashes`` held per node; None = route by load only."""
        if self.index is None or not self.is_available:
            return None
        if not hashes:
            return {}
        try:
            async with asyncio.timeout(self.timeout):  # in this task: no task per lookup
                return await self.index.lookup(hashes)
        except (IndexUnavailable, RedisError, OSError, TimeoutError) as exc:
            self._set_available(False, exc)
            return None

    async def probe(self) -> None:
        """Bring the index back after an outage (a no-op while it is available)."""
        if self.index is None or self.is_available:
            return
        try:
            await asyncio.wait_for(self.index.lookup([_PROBE_HASH]), max(self.timeout, 1.0))
        except (IndexUnavailable, RedisError, OSError, TimeoutError):
            return
        self._set_available(True, None)

    def _set_available(self, available: bool, exc: BaseException | None) -> None:
        if available == self.is_available:
            return
        self.is_available = available
        metrics.INDEX_AVAILABLE.set(1 if available else 0)
        if available:
            log.info("prefix index available again: cache-aware routing resumed")
        else:
            log.warning("prefix index unavailable: routing by load only until Redis answers",
                        extra={"fields": {"error": repr(exc)}})
