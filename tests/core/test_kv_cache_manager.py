"""KV cache manager: block tables, prefix-cache hits, statistics, no leaks."""

from __future__ import annotations

from decodegraph.core.kv_cache_manager import KVCacheManager
from decodegraph.request import Request
from tests.utils.requests import make_request

BLOCK_SIZE = 4


def admit(kv: KVCacheManager, request: Request) -> int:
    """What the scheduler does for a new request computing its whole remainder."""
    blocks, num_computed = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_computed, blocks) is not None
    request.num_computed_tokens = num_computed
    return num_computed


def compute_all(kv: KVCacheManager, request: Request) -> None:
    """What update_from_output does after the step computed every scheduled token."""
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)


def test_allocation_rounds_tokens_up_to_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    req = make_request("a", list(range(9)))
    new = kv.allocate_slots(req, 9)
    assert new is not None and len(new) == 1  # one KV cache group
    (new_blocks,) = new
    assert len(new_blocks) == 3
    assert kv.get_block_ids("a") == [b.block_id for b in new_blocks]
    assert 0 not in kv.get_block_ids("a")
    assert kv.num_free_blocks == 9 - 3


def test_decode_allocates_a_block_only_when_the_last_one_is_full() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    req = make_request("a", list(range(7)))
    kv.allocate_slots(req, 7)
    req.num_computed_tokens = 7
    req.append_output_token(100)
    assert not any(kv.allocate_slots(req, 1))  # token 8 fits in block 2
    req.num_computed_tokens = 8
    req.append_output_token(101)
    new = kv.allocate_slots(req, 1)
    assert new is not None and len(new[0]) == 1
    assert len(kv.get_block_ids("a")) == 3


def test_allocation_fails_without_side_effects_when_blocks_run_out() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    req = make_request("a", list(range(9)))
    assert kv.allocate_slots(req, 9) is None
    assert kv.get_block_ids("a") == [] and kv.num_free_blocks == 2


def test_prefix_hit_reuses_block_ids_of_full_computed_blocks() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prefix = list(range(100, 108))  # two full blocks
    a = make_request("a", prefix + [1, 2, 3])
    assert admit(kv, a) == 0
    compute_all(kv, a)
    b = make_request("b", prefix + [7, 8])
    assert admit(kv, b) == 8
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2] != kv.get_block_ids("a")[2]
    assert kv.block_pool.blocks[kv.get_block_ids("a")[0]].ref_cnt == 2
    assert kv.prefix_cache_hits == 8
    assert kv.prefix_cache_queries == a.num_tokens + b.num_tokens


def test_prefix_hit_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prompt = list(range(8))  # exactly two full blocks
    a = make_request("a", prompt)
    admit(kv, a)
    compute_all(kv, a)
    b = make_request("b", prompt)
    blocks, num_computed = kv.get_computed_blocks(b)
    # Both blocks are cached, but the last token must run to produce logits: only
    # the first block can be reused (b.num_tokens - 1 = 7 tokens -> 1 full block).
    assert num_computed == 4 and len(blocks[0]) == 1


def test_prefix_hit_survives_free_until_eviction() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 3
    b = make_request("b", list(range(9)))
    assert admit(kv, b) == 8
    kv.free(b)
    # A request with different tokens needs all three blocks, evicting the cached ones.
    c = make_request("c", list(range(50, 61)))
    assert admit(kv, c) == 0
    d = make_request("d", list(range(9)))
    blocks, num_computed = kv.get_computed_blocks(d)
    assert num_computed == 0 and not any(blocks)


def test_cached_hits_in_the_free_queue_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)) + [99])
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    # b hits 2 free cached blocks and needs 2 more: 4 > 3 free, so it must not fit.
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5])
    blocks, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 8
    assert kv.allocate_slots(b, b.num_tokens - num_computed, blocks) is None
    assert kv.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in blocks[0])


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, enable_caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    compute_all(kv, a)
    b = make_request("b", list(range(9)))
    assert admit(kv, b) == 0
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0


def test_no_block_leaks_after_everything_is_freed() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    shared = list(range(12))
    requests = [make_request(str(i), shared + [i] * (i + 1)) for i in range(4)]
    for req in requests:
        admit(kv, req)
        compute_all(kv, req)
    assert kv.usage > 0
    for req in requests:
        kv.free(req)
    kv.free(requests[0])  # freeing twice is a no-op
    assert kv.num_free_blocks == 16 - 1
    assert kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks[1:])
    assert kv.reset_prefix_cache() is True


def test_block_hashes_chain_over_all_token_ids_including_outputs() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    a.num_computed_tokens = 3
    a.append_output_token(4)  # block 0 is now full of prompt + output
    kv.allocate_slots(a, 1)
    compute_all(kv, a)
    assert len(a.block_hashes) == 1
    b = make_request("b", [1, 2, 3, 4, 5])
    assert admit(kv, b) == 4
