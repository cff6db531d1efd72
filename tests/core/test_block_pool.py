"""The block pool: null block, reference counts, LRU free queue, prefix-cache hashes."""

from __future__ import annotations

import pytest

from decodegraph.core.block_pool import ROOT_BLOCK_HASH, BlockPool, hash_block_tokens


def test_null_block_is_never_allocated() -> None:
    pool = BlockPool(num_blocks=5)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4
    assert 0 not in pool.free_block_queue


def test_pool_needs_a_block_besides_the_null_block() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1)


def test_block_is_free_only_when_its_last_reference_drops() -> None:
    pool = BlockPool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    assert block.ref_cnt == 1
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free_block_queue
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block.block_id in pool.free_block_queue
    assert pool.usage == 0.0


def test_usage_counts_referenced_blocks_over_usable_blocks() -> None:
    pool = BlockPool(num_blocks=5)
    pool.get_new_blocks(1)
    assert pool.usage == pytest.approx(0.25)


def test_hash_chain_depends_on_parent_and_tokens() -> None:
    h1 = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(ROOT_BLOCK_HASH, (1, 2, 3, 4))
    assert h1 != hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 5])
    # Same tokens after a different prefix is a different block.
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(
        hash_block_tokens(ROOT_BLOCK_HASH, [9, 9, 9, 9]), [5, 6, 7, 8]
    )


def test_freed_cached_block_keeps_its_hash_until_evicted() -> None:
    pool = BlockPool(num_blocks=3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [111], 0, 1)
    pool.free_blocks([a, b])
    assert a.block_hash == 111 and pool.get_cached_block(111) is a
    # The unhashed block is recycled before the cached one.
    (first,) = pool.get_new_blocks(1)
    assert first is b and pool.get_cached_block(111) is a
    (second,) = pool.get_new_blocks(1)
    assert second is a
    assert a.block_hash is None and pool.get_cached_block(111) is None


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [10, 20, 30], 0, 3)
    # Freed in the order 2, 0, 1 (by position in `blocks`).
    for i in (2, 0, 1):
        pool.free_blocks([blocks[i]])
    evicted = [pool.get_new_blocks(1)[0] for _ in range(3)]
    assert evicted == [blocks[2], blocks[0], blocks[1]]


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(num_blocks=3)
    a, _ = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [7], 0, 1)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 1
    pool.touch([pool.get_cached_block(7)])  # type: ignore[list-item]
    assert a.ref_cnt == 1 and pool.num_free_blocks == 0


def test_duplicate_contents_keep_the_first_cached_block() -> None:
    pool = BlockPool(num_blocks=3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [5], 0, 1)
    pool.cache_full_blocks([b], [5], 0, 1)
    assert pool.get_cached_block(5) is a and b.block_hash is None


def test_caching_disabled_commits_nothing() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [5], 0, 1)
    assert a.block_hash is None and pool.get_cached_block(5) is None


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(num_blocks=3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [5], 0, 1)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(5) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(5) is None and a.block_hash is None
