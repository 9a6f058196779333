"""Block pool and KV manager with block size 16 and a dozen blocks: exact ids, eviction order."""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Request
from pdserve.hashing import hash_blocks
from pdserve.sampling_params import SamplingParams

BS, N = 16, 12


def _req(rid: str, tokens: list[int], salt: str = "") -> Request:
    return Request(rid, tokens, SamplingParams(), arrival=0, max_len=1000,
                   eos_token_ids=frozenset(), cache_salt=salt)


@pytest.fixture
def kv():
    manager = KVCacheManager(N, BS, "fp-test")
    yield manager
    manager.check_integrity()


def test_pool_allocates_in_order_and_frees_to_the_back() -> None:
    pool = BlockPool(N)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free([4, 3, 1])
    assert pool.free_order() == [5, 6, 7, 8, 9, 10, 11, 4, 3, 1]
    assert pool.allocate(8) == [5, 6, 7, 8, 9, 10, 11, 4]
    assert pool.allocate(3) is None  # only 3 and 1 are free: nothing taken
    assert pool.num_free == 2
    pool.check_integrity()


def test_pool_evicts_cached_blocks_lru_and_touch_revives() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert blocks == [0, 1, 2, 3]
    for b in blocks:
        assert pool.cache(b, bytes([b]) * 32)
    pool.free([2, 0, 3, 1])
    assert pool.lookup(bytes([0]) * 32) == 0
    pool.touch([0])                       # a prefix hit takes block 0 back
    assert pool.free_order() == [2, 3, 1]
    assert pool.allocate(1) == [2]        # LRU: block 2 evicted first
    assert pool.lookup(bytes([2]) * 32) is None
    assert pool.lookup(bytes([3]) * 32) == 3 and pool.num_evictions == 1
    pool.free([0, 2])
    pool.check_integrity()
    with pytest.raises(RuntimeError, match="ref_cnt"):
        pool.free([2])


def test_integrity_check_catches_corruption() -> None:
    pool = BlockPool(N)
    pool.allocate(2)
    pool.blocks[0].ref_cnt = 0  # used block silently dropped
    with pytest.raises(RuntimeError, match="free"):
        pool.check_integrity()


def test_manager_prefix_hit_ids_and_cap(kv: KVCacheManager) -> None:
    tokens = list(range(40))                 # 2 full blocks + 8
    a = _req("a", tokens)
    assert kv.get_computed_blocks(a) == []
    assert kv.allocate_slots(a, 40) == [0, 1, 2]
    a.num_computed_tokens = 40
    assert [p for _, p in kv.commit(a)] == [0, 1]
    assert a.block_hashes == hash_blocks(tokens, BS, "fp-test")
    b = _req("b", tokens[:32] + [99] * 5)  # same two full blocks
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert kv.allocate_slots(b, 5, hits) == [3]
    assert kv.blocks_of("b") == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2
    c = _req("c", tokens[:32])               # prompt = exactly the cached blocks
    assert kv.get_computed_blocks(c) == [0]  # the last token must be computed
    assert kv.get_computed_blocks(_req("d", tokens[:32], salt="tenant2")) == []
    kv.free(a)
    kv.free(b)
    # Tail-first: a frees 2 (0 and 1 are still b's), then b frees 3, 1, 0.
    assert kv.pool.free_order()[-4:] == [2, 3, 1, 0]


def test_manager_refuses_when_short_and_changes_nothing(kv: KVCacheManager) -> None:
    a = _req("a", list(range(180)))
    assert kv.allocate_slots(a, 180) is not None  # 12 blocks: the whole pool
    b = _req("b", [1, 2, 3])
    assert kv.allocate_slots(b, 3) is None
    assert kv.blocks_of("b") == [] and kv.pool.num_free == 0
    kv.free(a)


def test_eviction_order_follows_request_tails(kv: KVCacheManager) -> None:
    a = _req("a", list(range(48)))           # 3 full blocks
    kv.allocate_slots(a, 48)
    a.num_computed_tokens = 48
    kv.commit(a)
    kv.free(a)                               # queue: ..., 2, 1, 0 (tail first)
    big = _req("big", list(range(1000, 1000 + 9 * BS + 1)))
    assert kv.allocate_slots(big, 9 * BS + 1) == [3, 4, 5, 6, 7, 8, 9, 10, 11, 2]
    assert kv.pool.lookup(a.block_hashes[2]) is None      # tail evicted
    assert kv.pool.lookup(a.block_hashes[0]) == 0          # head survives
    assert kv.get_computed_blocks(_req("a2", list(range(48)))) == [0, 1]
    kv.free(big)


def test_import_registers_blocks_as_cached(kv: KVCacheManager) -> None:
    hashes = hash_blocks(list(range(64)), BS, "fp-test")
    todo, pages, pinned = kv.import_begin(hashes[:2])
    assert (todo, pages, pinned) == ([0, 1], [0, 1], [])
    kv.import_end([hashes[0], hashes[1]], pages, pinned)
    todo, pages, pinned = kv.import_begin(hashes)
    assert (todo, pages, pinned) == ([2, 3], [2, 3], [0, 1])
    kv.import_end(hashes[2:], pages, pinned)
    hits = kv.get_computed_blocks(_req("x", list(range(65))))
    assert hits == [0, 1, 2, 3]
    assert kv.pool.num_used == 0
