"""Block identity: the one chained hash used by router, engines and kvd (DESIGN.md §2).

    h_0 = SHA-256(ROOT || fingerprint || salt || tokens_0)
    h_i = SHA-256(h_{i-1} || fingerprint || salt || tokens_i)

Only full blocks are hashed. A cryptographic hash, because a collision would hand one request
another's KV; the optional per-tenant ``cache_salt`` keeps tenants from probing each other's
prefixes. ``block_checksum`` is the fast xxh3 checksum of a block's bytes that travels with it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import xxhash

HASH_LEN = 32
_ROOT = b"pdserve-block-v1"


def hash_block(
    parent: bytes | None,
    tokens: Sequence[int],
    model_fingerprint: str,
    cache_salt: str = "",
) -> bytes:
    """Return the 32-byte id of one full block whose predecessor's id is ``parent``."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else _ROOT)
    fp = model_fingerprint.encode()
    salt = cache_salt.encode()
    # Length-prefix the variable fields so no two (fingerprint, salt) pairs collide.
    h.update(struct.pack("<II", len(fp), len(salt)))
    h.update(fp)
    h.update(salt)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def kv_fingerprint(model_fingerprint: str, kv_dtype: str, layout: str = "NHD") -> str:
    """What a block's bytes depend on besides its tokens: the model and weights, the KV dtype
    and the page layout. Engines hash blocks with it, so instances that would read a block
    differently (float32 vs bfloat16 KV) never share one, through the index or a kvd."""
    return f"{model_fingerprint}|kv={kv_dtype}|{layout}"


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    model_fingerprint: str,
    cache_salt: str = "",
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained ids of every full block of ``token_ids`` (a trailing partial block is skipped)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], model_fingerprint,
                            cache_salt)
        ids.append(parent)
    return ids


def block_checksum(data: bytes | memoryview) -> int:
    """xxh3-64 of a block's bytes; verified by the receiver before a block is marked present."""
    return xxhash.xxh3_64_intdigest(data)
