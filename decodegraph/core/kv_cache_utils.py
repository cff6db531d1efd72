"""How many blocks each KV cache group gets out of a memory budget.

A full-attention group can use one block per `block_size` tokens of every running
request at full length; a sliding-window group at most each request's window, the block
it writes and the blocks of one step's new tokens. Sliding groups get what they can use
first (it is little), and the full group the rest; a budget too small for all of that
shares itself out in proportion to what each group could use.
"""

from __future__ import annotations

from collections.abc import Sequence

from decodegraph.core.kv_cache_spec import KVCacheGroupSpec, SlidingWindowSpec


def useful_blocks(
    group: KVCacheGroupSpec, max_num_reqs: int, max_num_tokens: int, max_model_len: int
) -> int:
    """The most blocks `group` can hold at once (the null block included)."""
    bs = group.spec.block_size
    full = max_num_reqs * -(-max_model_len // bs) + 1
    if not isinstance(group.spec, SlidingWindowSpec):
        return full
    windows = max_num_reqs * (group.spec.window_blocks + 2) + -(-max_num_tokens // bs) + 1
    return min(full, windows)


def kv_cache_block_counts(
    groups: Sequence[KVCacheGroupSpec],
    bytes_per_block: Sequence[int],
    budget_bytes: int,
    max_num_reqs: int,
    max_num_tokens: int,
    max_model_len: int,
) -> list[int]:
    """Blocks per group (null block included) for a budget of `budget_bytes`."""
    useful = [useful_blocks(g, max_num_reqs, max_num_tokens, max_model_len) for g in groups]
    budget = max(0, budget_bytes)
    sliding = [i for i, g in enumerate(groups) if isinstance(g.spec, SlidingWindowSpec)]
    full = [i for i in range(len(groups)) if i not in sliding]
    counts = [0] * len(groups)
    reserved = sum(useful[i] * bytes_per_block[i] for i in sliding)
    one_sequence = [-(-max_model_len // groups[i].spec.block_size) + 1 for i in full]
    if (
        reserved + sum(n * bytes_per_block[i] for n, i in zip(one_sequence, full, strict=True))
        <= budget
    ):
        for i in sliding:
            counts[i] = useful[i]
        left = budget - reserved
        for i in full:  # one full group in every model we know; share evenly otherwise
            counts[i] = min(useful[i], left // len(full) // bytes_per_block[i])
        return counts
    ideal = sum(u * b for u, b in zip(useful, bytes_per_block, strict=True))
    return [u * budget // ideal for u in useful]
