"""BlockPool and KVCacheManager: pure bookkeeping over block ids."""

import numpy as np
import pytest

from kvcache import BlockPool, KVCacheManager, blocks_needed, slot_mapping
from kvcache.manager import slot_mappings


def test_pool_allocates_distinct_blocks_fifo_and_counts_free():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4 and pool.usage() == 0.0
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.usage() == pytest.approx(0.75)
    pool.free([1])
    pool.free([0])
    # Least recently freed first: 3 (never used), then 1, then 0.
    assert pool.allocate(3) == [3, 1, 0]
    assert pool.num_free_blocks == 0


def test_pool_refuses_more_than_free():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2  # nothing taken by the failed call


def test_pool_refcounts_keep_shared_blocks_until_last_free():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.free([b])
    assert pool.num_free_blocks == 2  # one holder left
    pool.free([b])
    assert pool.num_free_blocks == 3


def test_pool_double_free_and_touch_of_free_uncached_block_raise():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    with pytest.raises(RuntimeError):
        pool.touch([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([1])  # never allocated
    assert pool.num_free_blocks == 2


def test_pool_rejects_empty():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_blocks_needed():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_manager_allocate_grows_table_only_when_a_block_fills():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.num_new_blocks("a", 5) == 2
    assert kv.allocate_slots("a", 5)
    assert kv.block_table("a") == [0, 1] and kv.num_free_blocks == 3
    assert kv.num_new_blocks("a", 8) == 0
    assert kv.allocate_slots("a", 8)  # still within two blocks
    assert kv.block_table("a") == [0, 1] and kv.num_free_blocks == 3
    assert kv.allocate_slots("a", 9)
    assert kv.block_table("a") == [0, 1, 2] and kv.num_free_blocks == 2
    assert kv.allocate_slots("b", 3)
    assert kv.block_table("b") == [3]
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 5


def test_manager_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots("a", 8)
    assert not kv.allocate_slots("b", 8)  # needs 2, 1 free
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    assert not kv.allocate_slots("a", 13)  # needs 2 more
    assert kv.block_table("a") == [0, 1] and kv.num_free_blocks == 1
    kv.free("a")
    kv.free("b")  # never got blocks: a no-op
    assert kv.num_free_blocks == 3


def test_manager_truncate_rollback_frees_only_emptied_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.allocate_slots("a", 14)  # positions 0..13: 4 blocks
    table = list(kv.block_table("a"))
    assert kv.num_free_blocks == 2
    kv.truncate("a", 9)  # keep 0..8: block 2 still holds position 8
    assert kv.block_table("a") == table[:3] and kv.num_free_blocks == 3
    kv.truncate("a", 8)  # keep 0..7: block 2 now empty
    assert kv.block_table("a") == table[:2] and kv.num_free_blocks == 4
    kv.truncate("a", 8)  # idempotent
    assert kv.num_free_blocks == 4
    kv.truncate("missing", 0)  # unknown request: nothing happens
    assert kv.allocate_slots("a", 12)  # grows again after a rollback
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 3
    kv.free("a")
    assert kv.num_free_blocks == 6
    kv.free("a")  # second free of a request is a no-op, not a double free of blocks
    assert kv.num_free_blocks == 6 and kv.block_table("a") == []


def test_slot_mapping_worked_example():
    # The picture in kvcache/manager.py: block_size 4, block_table [7, 2].
    np.testing.assert_array_equal(slot_mapping([7, 2], 0, 8, 4), [28, 29, 30, 31, 8, 9, 10, 11])
    np.testing.assert_array_equal(slot_mapping([7, 2], 3, 6, 4), [31, 8, 9])
    assert slot_mapping([7, 2], 5, 5, 4).shape == (0,)
    assert slot_mapping([7, 2], 0, 8, 4).dtype == np.int64


def test_slot_mappings_of_a_step_are_each_requests_in_turn():
    # Request a: the picture's table, 6 positions; b: a longer table than it needs, 3; c: none.
    slots = slot_mappings([[7, 2], [5, 1, 9], []], np.array([6, 3, 0]), 4)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9] + [20, 21, 22]
    assert slots.dtype == np.int64
    with pytest.raises(IndexError):  # never a read into the next request's table
        slot_mappings([[7], [5, 1]], np.array([5, 1]), 4)
