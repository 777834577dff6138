"""BlockPool: ref counts, LRU free queue, hash map."""

import pytest

from rivulet.core import BlockPool


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def test_new_blocks_come_from_the_front_with_one_reference() -> None:
    pool = BlockPool(4)
    assert free_order(pool) == [0, 1, 2, 3]
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert free_order(pool) == [2, 3] and pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_least_recently_freed_cached_block_is_evicted_first() -> None:
    pool = BlockPool(4)
    b = pool.get_new_blocks(4)
    for i, block in enumerate(b):
        pool.cache_block(block, 100 + i)
    for i in (2, 0, 3, 1):
        pool.free_blocks([b[i]])
    assert free_order(pool) == [2, 0, 3, 1]
    assert all(pool.get_cached_block(100 + i) is b[i] for i in range(4))  # free but still cached
    (new,) = pool.get_new_blocks(1)
    assert new is b[2] and new.block_hash is None
    assert pool.get_cached_block(102) is None
    assert pool.get_cached_block(100) is b[0] and pool.get_cached_block(101) is b[1]
    assert [x.block_id for x in pool.get_new_blocks(2)] == [0, 3]
    assert set(pool.cached) == {101}


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(3)
    b = pool.get_new_blocks(3)
    pool.cache_block(b[0], 7)
    pool.free_blocks([b[0], b[1], b[2]])
    assert free_order(pool) == [2, 1, 0]
    assert [x.block_id for x in pool.get_new_blocks(2)] == [2, 1]
    assert pool.get_cached_block(7) is b[0]


def test_hit_on_free_cached_block_pulls_it_from_the_middle() -> None:
    pool = BlockPool(3)
    b = pool.get_new_blocks(3)
    for i, block in enumerate(b):
        pool.cache_block(block, 10 + i)
    pool.free_blocks(b)
    assert free_order(pool) == [0, 1, 2]
    hit = pool.get_cached_block(11)
    assert hit is b[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_order(pool) == [0, 2]
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.free_blocks([hit])
    assert free_order(pool) == [0, 2]
    pool.free_blocks([hit])
    assert free_order(pool) == [0, 2, 1]  # now the most recently freed
    assert hit.block_hash == 11 and pool.get_cached_block(11) is hit  # the hash was reused


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])
    assert pool.num_free_blocks == 2 and b.ref_cnt == 0


def test_first_block_registered_under_a_hash_keeps_it() -> None:
    pool = BlockPool(2)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, 5)
    pool.cache_block(b1, 5)
    assert pool.get_cached_block(5) is b0 and b1.block_hash is None
    pool.cache_block(b0, 6)  # a block's hash never changes while it lives
    assert b0.block_hash == 5 and pool.get_cached_block(6) is None


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 5)
    assert pool.get_cached_block(5) is None and b.block_hash is None


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(2)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, 1)
    pool.free_blocks([b0])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(1) is b0
    pool.free_blocks([b1])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(1) is None and b0.block_hash is None
    assert pool.num_free_blocks == 2
