"""Per-tenant quotas: a token bucket (tokens per minute) and a concurrency cap.

The quotas file is JSON::

    {"default": {"tokens_per_minute": 100000, "max_concurrent": 16},
     "tenants": {"team-a": {"tokens_per_minute": 20000, "max_concurrent": 4, "burst_tokens": 4000}}}

A request is charged ``prompt_tokens + max_tokens`` when admitted (it may generate that many)
and refunded what it did not generate when it ends, so a tenant is never over its rate even
while its requests are still running. Tenants without an entry get ``default``; with no
``default`` they are unlimited.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TenantQuota:
    tokens_per_minute: float | None = None  # None: no rate limit
    max_concurrent: int | None = None  # None: no concurrency cap
    burst_tokens: float | None = None  # bucket size; default one minute of tokens

    def __post_init__(self) -> None:
        if self.tokens_per_minute is not None and not self.tokens_per_minute > 0:
            raise ValueError(f"tokens_per_minute must be > 0, got {self.tokens_per_minute}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        if self.burst_tokens is not None and not self.burst_tokens > 0:
            raise ValueError(f"burst_tokens must be > 0, got {self.burst_tokens}")

    @property
    def capacity(self) -> float:
        if self.burst_tokens is not None:
            return self.burst_tokens
        return self.tokens_per_minute if self.tokens_per_minute is not None else math.inf


class QuotaExceeded(Exception):
    """Admission refused; ``retry_after`` seconds (None: retrying cannot help)."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def load_quotas(path: str) -> dict[str, TenantQuota]:
    """Parse a quotas file; ``""`` is the default. Errors name the file and the entry."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--quotas-file: cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--quotas-file: {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or set(data) - {"default", "tenants"}:
        raise ValueError(f"--quotas-file: {path} must be an object with keys 'default', 'tenants'")
    entries: dict[str, Any] = dict(data.get("tenants") or {})
    if "default" in data:
        entries[""] = data["default"]
    out = {}
    for tenant, spec in entries.items():
        where = f"--quotas-file: {path}: " + (f"tenants.{tenant}" if tenant else "default")
        if not isinstance(spec, dict):
            raise ValueError(f"{where} must be an object")
        try:
            out[tenant] = TenantQuota(**spec)
        except TypeError as exc:
            raise ValueError(f"{where}: unknown field ({exc})") from exc
        except ValueError as exc:
            raise ValueError(f"{where}.{exc}") from exc
    return out


@dataclass
class _Bucket:
    tokens: float
    updated: float
    num_active: int = 0


@dataclass
class QuotaBook:
    """Admission control for every tenant; one per router, touched only from its event loop."""

    quotas: dict[str, TenantQuota]
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def quota_of(self, tenant: str) -> TenantQuota | None:
        return self.quotas.get(tenant, self.quotas.get(""))

    def acquire(self, tenant: str, num_tokens: int) -> None:
        """Admit a request that may use ``num_tokens``, or raise ``QuotaExceeded``."""
        quota = self.quota_of(tenant)
        if quota is None:
            return
        bucket = self._refill(tenant, quota)
        if quota.max_concurrent is not None and bucket.num_active >= quota.max_concurrent:
            raise QuotaExceeded(f"tenant {tenant!r}: {bucket.num_active} requests in flight, "
                                f"quota max_concurrent={quota.max_concurrent}", 1.0)
        if quota.tokens_per_minute is not None:
            if num_tokens > quota.capacity:
                raise QuotaExceeded(
                    f"tenant {tenant!r}: request needs {num_tokens} tokens (prompt + max_tokens), "
                    f"above the quota's burst of {quota.capacity:.0f}; lower max_tokens", None)
            if bucket.tokens < num_tokens:
                rate = quota.tokens_per_minute / 60.0
                wait = (num_tokens - bucket.tokens) / rate
                raise QuotaExceeded(f"tenant {tenant!r}: token rate quota "
                                    f"({quota.tokens_per_minute:g}/min) exceeded", wait)
            bucket.tokens -= num_tokens
        bucket.num_active += 1

    def release(self, tenant: str, unused_tokens: int) -> None:
        """End of an admitted request: free its slot, refund tokens it did not generate."""
        quota = self.quota_of(tenant)
        if quota is None:
            return
        bucket = self._refill(tenant, quota)
        bucket.num_active = max(0, bucket.num_active - 1)
        bucket.tokens = min(quota.capacity, bucket.tokens + max(0, unused_tokens))

    def _refill(self, tenant: str, quota: TenantQuota) -> _Bucket:
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(quota.capacity, now)
        elif quota.tokens_per_minute is not None:
            gained = (now - bucket.updated) * quota.tokens_per_minute / 60.0
            bucket.tokens = min(quota.capacity, bucket.tokens + gained)
        bucket.updated = now
        return bucket
