"""The one block-hash function: chained, salted, full blocks only."""

from __future__ import annotations

import pytest

from pdserve.hashing import HASH_LEN, block_checksum, hash_blocks


def test_only_full_blocks_are_hashed() -> None:
    assert hash_blocks(list(range(15)), 16, "m") == []
    assert len(hash_blocks(list(range(33)), 16, "m")) == 2


def test_chain_shares_prefix_and_diverges_after() -> None:
    a = hash_blocks(list(range(48)), 16, "m")
    b = hash_blocks(list(range(32)) + [999] * 16, 16, "m")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(len(h) == HASH_LEN for h in a)
    # The same tokens in block 1 after a different block 0 get a different id (chaining).
    c = hash_blocks([7] * 16 + list(range(16, 32)), 16, "m")
    assert c[1] != a[1]


def test_fingerprint_and_salt_separate_caches() -> None:
    tokens = list(range(16))
    base = hash_blocks(tokens, 16, "m")[0]
    assert hash_blocks(tokens, 16, "other")[0] != base
    assert hash_blocks(tokens, 16, "m", cache_salt="tenant-a")[0] != base
    # Length-prefixing: moving characters between fingerprint and salt changes the id.
    assert hash_blocks(tokens, 16, "ab", "c")[0] != hash_blocks(tokens, 16, "a", "bc")[0]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1, 2], 0, "m")


def test_checksum_detects_a_flipped_byte() -> None:
    data = bytearray(range(256)) * 64
    before = block_checksum(bytes(data))
    data[1000] ^= 1
    assert block_checksum(bytes(data)) != before
