"""Engine instance registry in Redis: engines announce themselves, routers list them.

One key per instance, ``{prefix}instance:{instance_id}`` -> JSON record, written with a TTL.
An engine refreshes its key from ``heartbeat_task`` well within the TTL; an instance whose
heartbeat stops simply expires, so a crashed engine leaves the registry without anyone
cleaning up after it. JSON, never pickle: the registry is read by every router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

from redis.exceptions import RedisError

from pdserve.env import is_host_port
from pdserve.roles import Role

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "pdserve:"


@dataclass(frozen=True)
class InstanceRecord:
    """How a router reaches one engine instance, and which kvd node it shares."""

    instance_id: str
    role: str  # prefill | decode | colocated | flex
    address: str  # engine gRPC host:port
    kvd_node_id: str = ""  # empty: no kvd (colocated quick start)
    kvd_address: str = ""
    model: str = ""
    block_size: int = 16

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise ValueError("instance_id must not be empty")
        if self.role not in tuple(Role):
            raise ValueError(f"role must be one of {', '.join(Role)}, got {self.role!r}")
        if not is_host_port(self.address):
            raise ValueError(f"address must be host:port, got {self.address!r}")
        if self.kvd_address and not is_host_port(self.kvd_address):
            raise ValueError(f"kvd_address must be host:port, got {self.kvd_address!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> InstanceRecord:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("instance record must be a JSON object")
        known = set(cls.__dataclass_fields__)
        # Unknown keys come from newer writers: ignored, so the format can grow compatibly.
        return cls(**{k: v for k, v in data.items() if k in known})


def _key(prefix: str, instance_id: str) -> str:
    return f"{prefix}instance:{instance_id}"


async def register_instance(redis: Any, record: InstanceRecord, ttl: float,
                            prefix: str = DEFAULT_PREFIX) -> None:
    """Write (or refresh) ``record``; it expires ``ttl`` seconds later unless refreshed."""
    if ttl <= 0:
        raise ValueError(f"ttl must be > 0, got {ttl}")
    await redis.set(_key(prefix, record.instance_id), record.to_json(), px=int(ttl * 1000))


async def deregister_instance(redis: Any, instance_id: str,
                              prefix: str = DEFAULT_PREFIX) -> None:
    """Remove an instance at once (graceful shutdown) instead of waiting for its TTL."""
    await redis.delete(_key(prefix, instance_id))


async def list_instances(redis: Any, prefix: str = DEFAULT_PREFIX) -> list[InstanceRecord]:
    """Every live instance, sorted by id. A malformed record is logged and skipped."""
    keys = [k async for k in redis.scan_iter(match=f"{prefix}instance:*", count=1000)]
    if not keys:
        return []
    values = await redis.mget(keys)
    out = []
    for key, value in zip(keys, values, strict=True):
        if value is None:  # expired between SCAN and MGET
            continue
        try:
            out.append(InstanceRecord.from_json(value))
        except (ValueError, TypeError) as exc:
            log.warning("skipping malformed registry record",
                        extra={"fields": {"key": key, "error": str(exc)}})
    return sorted(out, key=lambda r: r.instance_id)


async def heartbeat_task(redis: Any, record: InstanceRecord, ttl: float = 10.0,
                         interval: float | None = None, prefix: str = DEFAULT_PREFIX) -> None:
    """Keep ``record`` registered until cancelled; then deregister it (best effort).

    Run it with ``asyncio.create_task``. Redis being down is logged once per outage and
    retried every ``interval`` (default ttl/3, so two missed beats still keep the key).
    """
    interval = ttl / 3 if interval is None else interval
    if not 0 < interval < ttl:
        raise ValueError(f"interval must be in (0, ttl={ttl}), got {interval}")
    failing = False
    try:
        while True:
            try:
                await register_instance(redis, record, ttl, prefix)
                if failing:
                    log.info("registry heartbeat restored")
                failing = False
            except (RedisError, OSError) as exc:
                _log_outage(failing, exc)
                failing = True
            await asyncio.sleep(interval)
    finally:
        # Best effort on the way out: the TTL removes the key anyway.
        with contextlib.suppress(RedisError, OSError, asyncio.CancelledError):
            await asyncio.shield(deregister_instance(redis, record.instance_id, prefix))


def _log_outage(already: bool, exc: BaseException) -> None:
    if not already:
        log.warning("registry heartbeat failed; retrying", extra={"fields": {"error": str(exc)}})
