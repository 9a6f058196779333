"""API keys: ``Authorization: Bearer <key>`` -> tenant id.

Keys come from ``--keys-file`` (one ``key[,tenant]`` a line; ``#`` comments and blank lines
skipped) and ``--api-keys``. A key without a tenant gets ``key-<first 8 hex of its SHA-256>``, so
the raw secret never reaches the router, its quotas or any log. Keys are stored by digest:
looking one up compares digests, not the secret itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from pdserve.env import ConfigError
from services.gateway.errors import unauthorized


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def default_tenant(key: str) -> str:
    return f"key-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


class KeyStore:
    """Known keys. Empty = authentication off (every request is tenant "")."""

    def __init__(self, entries: Iterable[tuple[str, str]] = ()) -> None:
        self._tenants: dict[bytes, str] = {}
        for key, tenant in entries:
            if not key:
                raise ValueError("API key must not be empty")
            self._tenants[_digest(key)] = tenant or default_tenant(key)

    @classmethod
    def load(cls, keys_file: str, api_keys: Iterable[str]) -> KeyStore:
        """From the config's fields; a bad file raises ConfigError naming ``--keys-file``."""
        entries = [(k, "") for k in api_keys]
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
                key, _, tenant = (part.strip() for part in line.partition(","))
                if not key or any(c.isspace() for c in key):
                    raise ConfigError(f"--keys-file: line {num}: expected 'key[,tenant]'")
                entries.append((key, tenant))
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

