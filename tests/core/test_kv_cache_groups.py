"""KV cache groups in the scheduler: a full-attention group beside a sliding-window one.

The scheduler test driver (`KVModel`) reads every token's context back through each
group's block table: all of it through the full group, the last W positions through
the sliding group, whose freed blocks it never reads. A wrong table in either group, a
freed block still in use, or a bad prefix hit changes the output against a roomy run.
"""

from __future__ import annotations

import pytest

from decodegraph.config import CacheConfig, SchedulerConfig
from decodegraph.core.kv_cache_manager import KVCacheManager
from decodegraph.core.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    kv_cache_groups,
)
from decodegraph.core.scheduler import Scheduler
from tests.core.test_scheduler import BLOCK_SIZE, KVModel, assert_all_blocks_free, step
from tests.utils.requests import make_request

WINDOW = 6  # 6 positions: a token needs the blocks of the 5 before it (2 blocks of 4)


def groups(window: int = WINDOW) -> list[KVCacheGroupSpec]:
    return [
        KVCacheGroupSpec("full_attention", FullAttentionSpec(BLOCK_SIZE), (0, 2)),
        KVCacheGroupSpec("sliding_attention", SlidingWindowSpec(BLOCK_SIZE, window), (1, 3)),
    ]


def make(
    num_blocks: list[int],
    max_num_batched_tokens: int | None = None,
    prefix_caching: bool = True,
    window: int = WINDOW,
) -> tuple[Scheduler, KVModel]:
    sched = Scheduler(
        SchedulerConfig(16, max_num_batched_tokens, True),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        max_model_len=256,
        num_blocks=num_blocks,
        kv_cache_groups=groups(window),
    )
    return sched, KVModel(num_blocks, groups=groups(window))


def run(sched: Scheduler, model: KVModel, prompts: dict[str, list[int]], **params) -> dict:
    reqs = [make_request(rid, p, **params) for rid, p in prompts.items()]
    for r in reqs:
        sched.add_request(r)
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        step(sched, model)
    assert not sched.has_unfinished_requests()
    return {r.request_id: r.output_token_ids for r in reqs}


PROMPTS = {f"r{i}": [(5 * i + j) % 40 + 1 for j in range(3 + 7 * i)] for i in range(4)}


def reference(**params) -> dict:
    return run(*make([512, 512], prefix_caching=False), PROMPTS, **params)


def test_groups_from_layer_windows() -> None:
    found = kv_cache_groups(16, [None, 64, None, 64, 64], max_model_len=4096)
    assert [(g.name, g.layer_indices) for g in found] == [
        ("full_attention", (0, 2)),
        ("sliding_attention", (1, 3, 4)),
    ]
    assert found[1].spec == SlidingWindowSpec(16, 64)
    # A window no request reaches past is full attention.
    (only,) = kv_cache_groups(16, [4096, 4096], max_model_len=4096)
    assert only.name == "full_attention" and only.layer_indices == (0, 1)


def test_the_sliding_group_frees_blocks_that_left_the_window() -> None:
    sched, model = make([128, 128])
    req = make_request("long", [1, 2, 3], max_tokens=60)
    sched.add_request(req)
    sliding = sched.kv_cache_manager.managers[1]
    spec = groups()[1].spec
    assert isinstance(spec, SlidingWindowSpec)
    while sched.has_unfinished_requests():
        step(sched, model)
        if not sched.has_unfinished_requests():
            break
        held = [b for b in sliding.req_to_blocks["long"] if b is not sliding.null_block]
        # The window's blocks, the block being written, and at most one just filled.
        assert len(held) <= spec.window_blocks + 2
    full = sched.kv_cache_manager.managers[0]
    assert sliding.pool.num_free_blocks == full.pool.num_free_blocks == 127


def test_memory_of_the_sliding_group_stays_bounded_over_a_long_generation() -> None:
    """The full group's blocks grow with the context; the sliding group's do not."""
    sched, model = make([256, 256])
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=400))
    full, sliding = sched.kv_cache_manager.managers
    most = 0
    for _ in range(400):
        step(sched, model)
        if not sched.has_unfinished_requests():
            break
        most = max(most, 255 - sliding.pool.num_free_blocks)
    assert most <= groups()[1].spec.window_blocks + 2
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("budget", [None, 5, 2])
def test_chunked_prefill_across_the_window_edge_gives_the_roomy_runs_outputs(
    budget: int | None,
) -> None:
    sched, model = make([256, 256], max_num_batched_tokens=budget or 256, prefix_caching=False)
    assert run(sched, model, PROMPTS, max_tokens=12) == reference(max_tokens=12)
    assert_all_blocks_free(sched)


def test_preemption_under_tight_budgets_in_both_groups_gives_the_same_outputs() -> None:
    sched, model = make([14, 9], prefix_caching=False)
    assert run(sched, model, PROMPTS, max_tokens=12) == reference(max_tokens=12)
    assert_all_blocks_free(sched)


def test_a_sliding_group_as_the_tight_one_preempts_and_chunks() -> None:
    """The full group has room; the sliding group's 5 blocks hold one request's window,
    the block after and a 2-block chunk: requests take turns, long prompts in chunks."""
    sched, model = make([256, 6], prefix_caching=False)
    assert sched.max_chunk_tokens == 2 * BLOCK_SIZE
    outputs = run(sched, model, PROMPTS, max_tokens=10)
    assert outputs == reference(max_tokens=10)
    assert_all_blocks_free(sched)


def test_without_chunked_prefill_a_prompt_the_sliding_group_cannot_hold_is_refused() -> None:
    """One step must hold a whole prompt (or a preempted request's recompute): requests
    are length-capped at what the sliding group holds, and a longer prompt is refused
    at once instead of waiting forever."""
    sched = Scheduler(
        SchedulerConfig(16, 256, False),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        max_model_len=256,
        num_blocks=[64, 7],
        kv_cache_groups=groups(),
    )
    assert sched.max_request_len == sched.max_chunk_tokens == 3 * BLOCK_SIZE
    with pytest.raises(ValueError, match="exceed the maximum length 12"):
        sched.add_request(make_request("long", list(range(1, 14))))
    model = KVModel([64, 7], groups=groups())
    outputs = run(sched, model, {"a": [3, 1, 4, 1, 5, 9, 2, 6]}, max_tokens=8)
    assert len(outputs["a"]) == 4  # capped at 12 tokens: 8 prompt + 4 generated
    assert_all_blocks_free(sched)


def test_a_prefix_hit_holds_in_both_groups_and_skips_freed_blocks() -> None:
    """A second request with the first's 20-token prefix hits 4 blocks in the full group;
    in the sliding group only the window's blocks before token 16 matter, the earlier
    ones are null in its table."""
    sched, model = make([64, 64])
    prefix = [(3 * j) % 37 + 1 for j in range(20)]
    first = run(sched, model, {"a": prefix + [5]}, max_tokens=4)
    kv = sched.kv_cache_manager
    b = make_request("b", prefix + [9, 9])
    hits, num_tokens = kv.get_computed_blocks(b)
    assert num_tokens == 20
    full_hit, sliding_hit = hits
    assert len(full_hit) == len(sliding_hit) == 5
    null = kv.managers[1].null_block
    need = groups()[1].spec.window_blocks
    assert all(blk is null for blk in sliding_hit[: 5 - need])
    assert all(blk is not null for blk in sliding_hit[5 - need :])
    outputs = run(sched, model, {"b": prefix + [9, 9]}, max_tokens=4)
    roomy = run(*make([512, 512], prefix_caching=False), {"b": prefix + [9, 9]}, max_tokens=4)
    assert outputs == roomy and first
    assert kv.prefix_cache_hits >= 20


def test_a_sliding_hit_needs_the_windows_blocks_still_cached() -> None:
    """Evict the sliding group's blocks that hold the window before token 20: the full
    group still holds the prefix, but the request's hit falls back to what both hold."""
    sched, model = make([64, 64])
    prefix = [(3 * j) % 37 + 1 for j in range(20)]
    run(sched, model, {"a": prefix + [5]}, max_tokens=4)
    kv = sched.kv_cache_manager
    sliding = kv.managers[1]
    probe = make_request("probe", prefix + [1])
    kv._update_block_hashes(probe, 5)
    for h in probe.block_hashes[3:5]:  # the window's blocks before token 20
        block = sliding.pool.get_cached_block(h)
        if block is not None:
            sliding.pool._evict(block)
    hits, num_tokens = kv.get_computed_blocks(make_request("b", prefix + [9]))
    assert num_tokens < 20 and len(hits[0]) == len(hits[1]) == num_tokens // BLOCK_SIZE


def test_a_hit_across_two_windows_holds_every_groups_window() -> None:
    """Windows of 2 and 3 blocks whose evicted blocks shorten each other's hit several
    times over: the hit settles where every group still holds its window (block 4),
    never on a length where one group's window reaches a freed block."""
    specs = [
        KVCacheGroupSpec("full_attention", FullAttentionSpec(BLOCK_SIZE), (0,)),
        KVCacheGroupSpec("sliding_9", SlidingWindowSpec(BLOCK_SIZE, 2 * BLOCK_SIZE + 1), (1,)),
        KVCacheGroupSpec("sliding_13", SlidingWindowSpec(BLOCK_SIZE, 3 * BLOCK_SIZE + 1), (2,)),
    ]
    assert [g.spec.window_blocks for g in specs[1:]] == [2, 3]
    kv = KVCacheManager(64, BLOCK_SIZE, True, specs)
    tokens = [(7 * j) % 41 + 1 for j in range(12 * BLOCK_SIZE + 1)]
    first = make_request("a", tokens)
    assert kv.allocate_slots(first, len(tokens), kv.get_computed_blocks(first)[0]) is not None
    first.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(first)
    kv.free(first)
    hashes = first.block_hashes
    for manager, evicted in zip(kv.managers[1:], ([7, 10], [4, 8]), strict=True):
        for i in evicted:
            manager.pool._evict(manager.pool.get_cached_block(hashes[i]))
    hits, num_tokens = kv.get_computed_blocks(make_request("b", tokens))
    length = num_tokens // BLOCK_SIZE
    assert length == 4 and all(len(h) == length for h in hits)
    for group, manager, hit in zip(specs, kv.managers, hits, strict=True):
        need = min(length, getattr(group.spec, "window_blocks", length))
        for i in range(length - need, length):
            assert hit[i] is manager.pool.get_cached_block(hashes[i]) is not None


def test_a_sliding_group_too_small_for_its_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding-window KV cache group"):
        make([64, 3])
