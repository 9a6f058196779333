"""The prefix index (block hash -> kvd nodes) and the kvd node registry.

``PrefixIndex`` is the plug point; ``RedisPrefixIndex`` is the real one (imported lazily so the
quick start runs without the redis package loaded), ``LocalPrefixIndex`` the in-process one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.index.base import IndexUnavailable, NodeRecord, PrefixIndex
from pdserve.index.local import LocalPrefixIndex

if TYPE_CHECKING:
    from pdserve.index.redis_index import RedisPrefixIndex

__all__ = ["IndexUnavailable", "LocalPrefixIndex", "NodeRecord", "PrefixIndex",
           "RedisPrefixIndex"]


def __getattr__(name: str) -> Any:
    if name == "RedisPrefixIndex":
        from pdserve.index.redis_index import RedisPrefixIndex

        return RedisPrefixIndex
    raise AttributeError(name)
