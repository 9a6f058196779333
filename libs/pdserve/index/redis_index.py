"""The Redis prefix index (redis.asyncio). Key layout under ``prefix`` (default ``pdserve:``):

    {p}blk:{hash hex}     ZSET  member node_id, score = expiry (ms since epoch)
    {p}nodeblk:{node_id}  SET   hash hex of every block the node added (for purge)
    {p}node:{node_id}     STR   NodeRecord JSON, expires with the heartbeat TTL
    {p}nodes              SET   node ids ever registered (pruned lazily by ``nodes()``)

Per-(block, node) expiry lives in the ZSET score, so one node's stale entry ages out without
touching another node's. ``lookup`` is one Lua script: one round trip however many hashes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdserve.index.base import IndexUnavailable, NodeRecord, PrefixIndex

_LOOKUP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local counts, running = {}, nil
for i, key in ipairs(KEYS) do
  local here = {}
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', key, now, '+inf')) do here[m] = true end
  if running == nil then
    running = {}
    for m, _ in pairs(here) do
      if redis.call('EXISTS', ARGV[1] .. 'node:' .. m) == 1 then running[m] = true end
    end
  else
    for m, _ in pairs(running) do
      if not here[m] then running[m] = nil end
    end
  end
  local any = false
  for m, _ in pairs(running) do counts[m] = (counts[m] or 0) + 1; any = true end
  if not any then break end
end
local out = {}
for m, c in pairs(counts) do table.insert(out, m); table.insert(out, c) end
return out
"""

_PURGE = """
local rec = redis.call('GET', KEYS[2])
if rec then
  local e = tonumber(cjson.decode(rec)['epoch'])
  if e and e > tonumber(ARGV[2]) then return -1 end
end
local members = redis.call('SMEMBERS', KEYS[1])
for _, h in ipairs(members) do redis.call('ZREM', ARGV[3] .. 'blk:' .. h, ARGV[1]) end
redis.call('DEL', KEYS[1])
return #members
"""


class RedisPrefixIndex(PrefixIndex):
    """``PrefixIndex`` on Redis; every Redis failure surfaces as ``IndexUnavailable``."""

    def __init__(self, url: str, prefix: str = "pdserve:", ttl_s: float = 300.0,
                 timeout_s: float = 1.0) -> None:
        if not url:
            raise ValueError("redis_url: must not be empty")
        self.prefix = prefix
        self.ttl_ms = int(ttl_s * 1000)
        # Short timeouts: a Redis outage must cost the caller a moment, never a stall.
        self._r = aioredis.Redis.from_url(url, socket_timeout=timeout_s,
                                          socket_connect_timeout=timeout_s)
        self._lookup = self._r.register_script(_LOOKUP)
        self._purge = self._r.register_script(_PURGE)

    def _blk(self, h: bytes) -> str:
        return f"{self.prefix}blk:{h.hex()}"

    async def add(self, node_id: str, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        expiry = int(time.time() * 1000) + self.ttl_ms
        nodeblk = f"{self.prefix}nodeblk:{node_id}"
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for h in hashes:
                    pipe.zadd(self._blk(h), {node_id: expiry})
                    pipe.pexpire(self._blk(h), self.ttl_ms)
                pipe.sadd(nodeblk, *[h.hex() for h in hashes])
                pipe.pexpire(nodeblk, self.ttl_ms)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(str(exc)) from exc

    async def remove(self, node_id: str, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for h in hashes:
                    pipe.zrem(self._blk(h), node_id)
                pipe.srem(f"{self.prefix}nodeblk:{node_id}", *[h.hex() for h in hashes])
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(str(exc)) from exc

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        if not hashes:
            return {}
        try:
            flat = await self._lookup(keys=[self._blk(h) for h in hashes], args=[self.prefix])
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(str(exc)) from exc
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def register_node(self, record: NodeRecord, ttl: float) -> None:
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.set(f"{self.prefix}node:{record.node_id}", record.to_json(),
                         px=max(1, int(ttl * 1000)))
                pipe.sadd(f"{self.prefix}nodes", record.node_id)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(str(exc)) from exc

    async def nodes(self) -> list[NodeRecord]:
        try:
            members = await self._r.smembers(f"{self.prefix}nodes")
            ids = sorted(m.decode() if isinstance(m, bytes) else m for m in members)
            if not ids:
                return []
            raw = await self._r.mget([f"{self.prefix}node:{i}" for i in ids])
            gone = [i for i, r in zip(ids, raw, strict=True) if r is None]
            if gone:
                await self._r.srem(f"{self.prefix}nodes", *gone)
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(str(exc)) from exc
        return [NodeRecord.from_json(r) for r in raw if r is not None]

    async def purge_node(self, node_id: str, epoch: int) -> int:
        keys = [f"{self.prefix}nodeblk:{node_id}", f"{self.prefix}node:{node_id}"]
        try:
            return int(await self._purge(keys=keys, args=[node_id, epoch, self.prefix]))
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(str(exc)) from exc

    async def close(self) -> None:
        await self._r.aclose()
