"""The prefix cache in the block pool and KVCacheManager: hash chains, shared
blocks by reference count, LRU eviction of unreferenced cached blocks, and
rollback that never frees a shared block. Pure bookkeeping, no model."""

import hashlib

import numpy as np
import pytest

from kvcache import BlockPool, KVCacheManager
from kvcache.block_hash import ROOT, extend_chain, hash_block

B = 4  # block size


def manager(num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(num_blocks, B, enable_prefix_caching=True)


def compute(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit ``rid`` as the scheduler does (cached prefix, then new blocks), 'compute'
    every token but the last and register the verified blocks; returns the hit blocks."""
    hit = kv.find_cached_prefix(rid, tokens)
    assert kv.allocate_slots(rid, len(tokens), hit)
    kv.cache_blocks(rid, tokens, len(tokens) - 1)
    return hit


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_hash_chain_is_blake2b_of_parent_and_int64_tokens():
    h0 = hash_block(ROOT, [1, 2, 3, 4])
    assert h0 == hashlib.blake2b(ROOT + np.array([1, 2, 3, 4], "<i8").tobytes(), digest_size=32).digest()
    h1 = hash_block(h0, [5, 6, 7, 8])
    assert h1 != hash_block(hash_block(ROOT, [9, 2, 3, 4]), [5, 6, 7, 8])  # same block, other prefix
    assert extend_chain([], list(range(1, 11)), 2, B) == [h0, h1]  # 10 tokens: 2 full blocks asked for
    chain = [h0]
    assert extend_chain(chain, list(range(1, 9)), 2, B) is chain and chain == [h0, h1]


def test_a_shared_prefix_reuses_blocks_by_reference():
    kv = manager()
    a = list(range(100, 114))  # 14 tokens: blocks 0-2 full and verified
    assert compute(kv, "a", a) == []
    assert kv.pool.num_cached_blocks == 3
    b = a[:10] + [7, 7, 7, 7, 7]  # shares 2 full blocks (and half of the third)
    hit = compute(kv, "b", b)
    assert hit == kv.block_table("a")[:2] == kv.block_table("b")[:2]
    assert kv.block_table("b")[2:] != kv.block_table("a")[2:3]
    assert [kv.pool.ref_count(x) for x in hit] == [2, 2]
    kv.free("a")
    assert [kv.pool.ref_count(x) for x in hit] == [1, 1]  # b still holds them
    kv.free("b")
    assert_all_free(kv)  # cached-but-unreferenced blocks count as free
    assert kv.pool.num_cached_blocks == 4  # a's 3 blocks + b's third (its own content)


def test_a_hit_never_covers_the_block_of_the_last_token():
    kv = manager()
    a = list(range(12))
    compute(kv, "a", a + [99])  # 13 tokens: 3 full blocks cached
    assert len(kv.find_cached_prefix("x", a)) == 2  # 12 tokens: the 3rd block holds the last one
    assert len(kv.find_cached_prefix("y", a + [5])) == 3
    assert kv.find_cached_prefix("z", a[:4]) == []  # a one-block prompt is always computed
    for rid in ("a", "x", "y", "z"):
        kv.free(rid)
    assert_all_free(kv)


def test_cached_free_blocks_are_revived_and_counted_when_admitting():
    kv = manager(num_blocks=4)
    a = list(range(9))
    compute(kv, "a", a)  # 3 blocks, 2 full ones cached
    kv.free("a")
    assert_all_free(kv)
    hit = kv.find_cached_prefix("b", a)
    assert len(hit) == 2
    # 2 cached blocks leave the free queue + 1 new block for the last token.
    assert kv.num_new_blocks("b", 9, hit) == 3
    assert kv.allocate_slots("b", 9, hit)
    assert kv.num_free_blocks == 1 and kv.block_table("b")[:2] == hit
    kv.free("b")
    assert_all_free(kv)


def test_eviction_is_least_recently_freed_first_and_lookups_then_miss():
    kv = manager(num_blocks=6)
    a, b = list(range(0, 9)), list(range(50, 59))
    compute(kv, "a", a)  # blocks 0,1 cached + 2; then b: 3,4 cached + 5
    compute(kv, "b", b)
    kv.free("a")  # a first: its blocks are the least recently freed
    kv.free("b")
    assert_all_free(kv)
    assert kv.pool.num_cached_blocks == 4
    # A new request needs 2 blocks: a's uncached tail block, then a's second block (tail first).
    assert kv.allocate_slots("c", 8)
    assert kv.block_table("c") == [2, 1]
    assert kv.find_cached_prefix("a2", a) == [0]  # a's first block survived, the second was evicted
    assert kv.find_cached_prefix("b2", b) == [3, 4]  # b untouched
    assert kv.allocate_slots("d", 16)  # 4 more: 0 (a's last cached block), 5, and b's 4, 3 ...
    assert kv.find_cached_prefix("a3", a) == []
    assert kv.find_cached_prefix("b3", b) == []  # ... so b's prefix is gone too
    assert kv.pool.num_cached_blocks == 0
    for rid in ("a2", "b2", "a3", "b3", "c", "d"):
        kv.free(rid)
    assert_all_free(kv)


def test_the_first_block_registered_for_a_content_stays_the_cached_one():
    kv = manager()
    a = list(range(9))
    for rid in ("x", "y"):  # computed side by side, before either registered
        assert kv.allocate_slots(rid, len(a))
    kv.cache_blocks("x", a, 8)
    kv.cache_blocks("y", a, 8)
    assert kv.find_cached_prefix("z", a) == kv.block_table("x")[:2]
    assert not kv.pool.is_cached(kv.block_table("y")[0])
    for rid in ("x", "y", "z"):
        kv.free(rid)
    assert_all_free(kv)


def test_rollback_frees_only_draft_blocks_and_refuses_a_shared_one():
    kv = manager()
    prompt = list(range(10))
    compute(kv, "a", prompt)
    hit = kv.find_cached_prefix("b", prompt)
    assert kv.allocate_slots("b", 10 + 6, hit)  # 10 tokens + 6 draft slots: 4 blocks
    assert len(kv.block_table("b")) == 4
    kv.truncate("b", 11)  # one draft accepted: keep 11 positions
    assert kv.block_table("b")[:2] == hit and len(kv.block_table("b")) == 3
    assert [kv.pool.ref_count(x) for x in hit] == [2, 2]
    with pytest.raises(RuntimeError, match="shared block"):
        kv.truncate("b", 4)  # below the cached prefix: never done by the scheduler
    for rid in ("a", "b"):
        kv.free(rid)
    assert_all_free(kv)


def test_disabled_cache_finds_nothing_and_registers_nothing():
    kv = KVCacheManager(8, B)
    tokens = list(range(9))
    assert kv.allocate_slots("a", 9)
    kv.cache_blocks("a", tokens, 8)
    kv.free("a")
    assert kv.find_cached_prefix("b", tokens) == [] and kv.pool.num_cached_blocks == 0


def test_pool_touch_takes_a_cached_free_block_out_of_the_free_queue():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h")
    pool.free([b])
    assert pool.num_free_blocks == 3 and pool.cached_block(b"h") == b
    pool.touch([b])
    assert pool.num_free_blocks == 2 and pool.ref_count(b) == 1
    assert b not in pool.allocate(2)  # not evictable while held
    assert pool.cached_block(b"h") == b
