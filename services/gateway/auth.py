"""API keys: ``Authorization: Bearer <key>`` -> tenant id; and each tenant's cache salt.

Keys come from ``--keys-file`` (one ``key[,tenant[,cache_group]]`` a line; ``#`` comments and
blank lines skipped) and ``--api-keys``. A key without a tenant gets ``key-<first 8 hex of its
SHA-256>``, so the raw secret never reaches the router, its quotas or any log. Keys are stored
by digest: looking one up compares digests, not the secret itself.

Cache salts (DESIGN.md §2): every request's ``cache_salt`` is HMAC-SHA256 of its tenant (or of
the cache group an operator put the tenant in, on purpose) and of the request's own
``cache_salt`` field (vLLM's), keyed with ``PDSERVE_CACHE_SALT_SECRET``. Block hashes then
differ between tenants and cannot be predicted without the key, so ``cached_tokens`` and TTFT
tell a tenant only about its own history, and nobody can aim a block at another's prompt.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from pdserve.env import ConfigError
from services.gateway.errors import unauthorized

log = logging.getLogger(__name__)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def default_tenant(key: str) -> str:
    return f"key-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


class KeyStore:
    """Known keys. Empty = authentication off (every request is tenant "")."""

    def __init__(self, entries: Iterable[tuple[str, str] | tuple[str, str, str]] = ()) -> None:
        self._tenants: dict[bytes, str] = {}
        self._groups: dict[str, str] = {}  # tenant -> the cache group it shares on purpose
        for key, tenant, *group in entries:
            if not key:
                raise ValueError("API key must not be empty")
            tenant = tenant or default_tenant(key)
            self._tenants[_digest(key)] = tenant
            if group and group[0]:
                self._groups[tenant] = group[0]

    @classmethod
    def load(cls, keys_file: str, api_keys: Iterable[str]) -> KeyStore:
        """From the config's fields; a bad file raises ConfigError naming ``--keys-file``."""
        entries: list[tuple[str, str] | tuple[str, str, str]] = [(k, "") for k in api_keys]
        if keys_file:
            try:
                text = Path(keys_file).read_text()
            except OSError as exc:
                raise ConfigError(f"--keys-file: cannot read {keys_file!r}: "
                                  f"{exc.strerror}") from exc
            for num, line in enumerate(text.splitlines(), 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                key, tenant, group, *rest = [p.strip() for p in line.split(",")] + ["", ""]
                if not key or any(c.isspace() for c in key) or any(rest):
                    raise ConfigError(f"--keys-file: line {num}: expected "
                                      "'key[,tenant[,cache_group]]'")
                entries.append((key, tenant, group))
        return cls(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)

    def tenant(self, authorization: str | None) -> str:
        """The caller's tenant, or ApiError 401. With auth off, always ""."""
        if not self._tenants:
            return ""
        if not authorization:
            raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        tenant = self._tenants.get(_digest(key.strip()))
        if tenant is None:
            raise unauthorized("invalid API key")
        return tenant

    def cache_identity(self, tenant: str) -> str:
        """Whose cache a tenant's requests use: its own, or its group's."""
        group = self._groups.get(tenant)
        return f"group:{group}" if group else f"tenant:{tenant}"


class CacheSalter:
    """``cache_salt`` of a request: HMAC-SHA256(key, identity, the request's own salt)."""

    def __init__(self, key: str) -> None:
        if not key:
            # Without a configured key the salts still isolate tenants, but change on restart
            # and differ between gateway replicas (no cache hits across them).
            log.warning("PDSERVE_CACHE_SALT_SECRET not set: a random key for this process")
            key = os.urandom(32).hex()
        self._key = key.encode()

    def salt(self, identity: str, request_salt: str | None) -> str:
        message = f"{identity}\x00{request_salt or ''}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()
