"""Per-request block tables over the KV cache, per KV cache group, with prefix caching.

The scheduler asks four things of it: which of a new request's leading blocks are
already cached (`get_computed_blocks`), room for the tokens it is about to schedule
(`allocate_slots`, None when the cache is full), to give a request's blocks back
(`free`), and after a step to commit the blocks that became full (`cache_full_blocks`),
so that later requests with the same prefix reuse them.

Each KV cache group (kv_cache_spec.py) has its own pool of blocks and its own block
table per request; an allocation takes blocks from every group or from none. A
sliding-window group frees the blocks that fell wholly out of the window as a request
advances (its table keeps the null block there), so its memory stays O(window) per
request. A prefix-cache hit must hold in every group: the full group's hit is the longest
chain of cached blocks, a sliding group's the longest prefix whose last window of blocks
is cached, and the request's hit the longest length at which every group's holds (a
group looks again below a shorter group's hit until all agree).
"""

from __future__ import annotations

from collections.abc import Sequence

from decodegraph.core.block_pool import ROOT_BLOCK_HASH, BlockPool, KVCacheBlock, hash_block_tokens
from decodegraph.core.kv_cache_spec import (
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    full_attention_groups,
)
from decodegraph.request import Request

# Per group: blocks.
GroupBlocks = tuple[Sequence[KVCacheBlock], ...]


class GroupKVCacheManager:
    """One KV cache group's block tables over its own pool (vLLM's single-type manager)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, enable_caching: bool) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.null_block = self.pool.null_block
        self.window = spec if isinstance(spec, SlidingWindowSpec) else None
        # request id -> its blocks in token order (the null block where a sliding window
        # freed one), and the same table as block ids, kept in step.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        # request id -> its leading blocks committed to the prefix cache, or freed by the
        # window (both counted from the start).
        self.num_cached_blocks: dict[str, int] = {}
        self.num_skipped_blocks: dict[str, int] = {}

    def find_hit(self, hashes: Sequence[int], max_blocks: int) -> list[KVCacheBlock]:
        """The longest cached prefix of at most `max_blocks` blocks this group can use."""
        get = self.pool.get_cached_block
        if self.window is None:
            hit: list[KVCacheBlock] = []
            for i in range(max_blocks):
                block = get(hashes[i])
                if block is None:
                    break
                hit.append(block)
            return hit
        # A sliding window needs only its last window_blocks blocks cached: scan from the
        # right for the first run that long; a shorter run from block 0 also holds.
        need, run = self.window.window_blocks, 0
        for i in range(max_blocks - 1, -1, -1):
            if get(hashes[i]) is None:
                run = 0
                continue
            run += 1
            if run >= need:
                end = i + need
                return [self.null_block] * i + [get(hashes[j]) for j in range(i, end)]
        return [get(hashes[j]) for j in range(run)]

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later token's window reaches (sliding groups only)."""
        if self.window is None:
            return
        first_needed = self.window.first_needed_block(num_computed_tokens)
        skipped = self.num_skipped_blocks.get(req_id, 0)
        if first_needed <= skipped:
            return
        blocks, ids = self.req_to_blocks[req_id], self.req_to_block_ids[req_id]
        first_needed = min(first_needed, len(blocks))
        null = self.null_block
        freed = [b for b in blocks[skipped:first_needed] if b is not null]
        for i in range(skipped, first_needed):
            blocks[i] = null
            ids[i] = 0
        self.pool.free_blocks(freed)
        self.num_skipped_blocks[req_id] = first_needed
        # Freed blocks count as committed: cache_full_blocks starts after them.
        self.num_cached_blocks[req_id] = max(self.num_cached_blocks[req_id], first_needed)

    def num_blocks_to_allocate(
        self, req_id: str, num_tokens: int, hit: Sequence[KVCacheBlock]
    ) -> int:
        """Blocks to take from the free queue so the request holds `num_tokens` tokens
        (prefix-cache hits sitting in the free queue count: referencing them takes them)."""
        blocks = self.req_to_blocks.get(req_id)
        held = len(blocks) if blocks is not None else 0
        # Every token this step computes writes its K/V: its block must be real, even
        # where a window will free it a step later.
        needed = -(-num_tokens // self.block_size) - held - len(hit)
        null = self.null_block
        evictable = sum(1 for b in hit if b.ref_cnt == 0 and b is not null)
        return max(0, needed) + evictable

    def allocate(
        self, req_id: str, num_tokens: int, hit: Sequence[KVCacheBlock]
    ) -> list[KVCacheBlock]:
        """Hold `num_tokens` tokens: take the hits, then new blocks (enough are free)."""
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self.req_to_block_ids[req_id] = []
            self.num_cached_blocks[req_id] = 0
            self.num_skipped_blocks[req_id] = 0
        ids = self.req_to_block_ids[req_id]
        null = self.null_block
        if hit:
            self.pool.touch(b for b in hit if b is not null)
            blocks.extend(hit)
            ids.extend(b.block_id for b in hit)
            # Hits are committed already: cache_full_blocks starts after them; a sliding
            # hit's leading null blocks are the ones its window skipped.
            self.num_cached_blocks[req_id] = len(blocks)
            self.num_skipped_blocks[req_id] = next(
                (i for i, b in enumerate(hit) if b is not null), len(hit)
            )
        num_blocks = -(-num_tokens // self.block_size)
        if len(blocks) >= num_blocks:
            return []
        new = self.pool.get_new_blocks(num_blocks - len(blocks))
        blocks.extend(new)
        ids.extend(b.block_id for b in new)
        return new

    def cache_full_blocks(self, req_id: str, hashes: Sequence[int], num_full: int) -> None:
        num_cached = self.num_cached_blocks.get(req_id)
        if num_cached is None or num_full <= num_cached:
            return
        blocks = self.req_to_blocks[req_id]
        num_full = min(num_full, len(blocks))
        self.pool.cache_full_blocks(blocks, hashes, num_cached, num_full)
        self.num_cached_blocks[req_id] = num_full

    def free(self, req_id: str) -> None:
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks is None:
            return
        del self.req_to_block_ids[req_id]
        del self.num_cached_blocks[req_id]
        self.num_skipped_blocks.pop(req_id, None)
        null = self.null_block
        self.pool.free_blocks(b for b in reversed(blocks) if b is not null)


class KVCacheManager:
    """Block tables of the running requests, per KV cache group, and the prefix-cache
    bookkeeping. Without groups given, one full-attention group."""

    def __init__(
        self,
        num_blocks: int | Sequence[int],
        block_size: int,
        enable_caching: bool = True,
        groups: Sequence[KVCacheGroupSpec] | None = None,
    ) -> None:
        self.groups = list(groups) if groups is not None else full_attention_groups(block_size, 1)
        sizes = [num_blocks] * len(self.groups) if isinstance(num_blocks, int) else list(num_blocks)
        if len(sizes) != len(self.groups):
            raise ValueError(f"num_blocks: one count per KV cache group ({len(self.groups)})")
        if any(g.spec.block_size != block_size for g in self.groups):
            raise ValueError("block_size: every KV cache group must use the cache's block size")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.managers = [
            GroupKVCacheManager(g.spec, n, enable_caching)
            for g, n in zip(self.groups, sizes, strict=True)
        ]
        self._windowed = [m for m in self.managers if m.window is not None]
        # What allocate_slots returns when nothing was allocated: callers may test for it
        # by identity.
        self.nothing_new: GroupBlocks = tuple(() for _ in self.managers)
        # The most tokens one request can hold in the full-attention groups (None: there
        # are none), and the most one step can compute for one request in the sliding
        # groups: its chunk, its window and the block after must fit at once, since a
        # sliding group frees only blocks that left the window (None: no sliding group).
        full = [m.pool.num_blocks - 1 for m in self.managers if m.window is None]
        self.max_request_tokens = min(full) * block_size if full else None
        self.max_chunk_tokens = min(
            [
                (m.pool.num_blocks - 1 - m.window.window_blocks - 1) * block_size
                for m in self._windowed
            ],
            default=None,
        )
        # Prefix-cache statistics in tokens, counted once per admitted lookup.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def block_pool(self) -> BlockPool:
        """The first group's pool (the only one of a model without sliding windows)."""
        return self.managers[0].pool

    @property
    def num_blocks(self) -> list[int]:
        """Usable blocks per group (the null block excluded)."""
        return [m.pool.num_blocks - 1 for m in self.managers]

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]: the fullest group's."""
        return max(m.pool.usage for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, in the group with the fewest (free,
        cached-but-unused ones included)."""
        return min(m.pool.num_free_blocks for m in self.managers)

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Extend `request.block_hashes` to cover its first `num_full_blocks` blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        token_ids = request.all_token_ids
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Per group, the cached full blocks that prefix the request's tokens, and the
        number of tokens they hold (the same for every group).

        At least one token is always left to compute, because the last token's forward
        produces the logits to sample from. The blocks are not referenced yet: pass them
        to `allocate_slots` before any other allocation.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.nothing_new, 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._update_block_hashes(request, max_blocks)
        # Each group's hit can shorten the others': look again below the shortest until
        # all agree (each round is shorter, so this ends; one group agrees at once).
        hits = [m.find_hit(hashes, max_blocks) for m in self.managers]
        while True:
            length = min(len(h) for h in hits)
            if all(len(h) == length for h in hits):
                return tuple(hits), length * self.block_size
            hits = [h if len(h) == length else m.find_hit(hashes, length)
                    for h, m in zip(hits, self.managers, strict=True)]  # fmt: skip

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
    ) -> GroupBlocks | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones,
        in every group.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` for a
        request being admitted (pass an empty tuple for an admission without hits, so
        the lookup is counted in the statistics); `request.num_computed_tokens` must not
        include them yet. Returns the newly allocated blocks per group, or None (and
        changes nothing) when some group has too few free blocks.
        """
        req_id = request.request_id
        computed = request.num_computed_tokens
        for m in self._windowed:
            if req_id in m.req_to_blocks:
                m.remove_skipped_blocks(req_id, computed)
        if new_computed_blocks is None:
            # Every group's table of a request has the same length: the first one's tells.
            blocks = self.managers[0].req_to_blocks.get(req_id)
            if blocks is not None and computed + num_new_tokens <= len(blocks) * self.block_size:
                return self.nothing_new  # a running request whose tokens fit (most decodes)
        hits = new_computed_blocks or self.nothing_new
        num_hit_tokens = len(hits[0]) * self.block_size if hits and hits[0] else 0
        num_tokens = computed + num_hit_tokens + num_new_tokens
        for m, hit in zip(self.managers, hits, strict=True):
            if m.num_blocks_to_allocate(req_id, num_tokens, hit) > m.pool.num_free_blocks:
                return None
        if new_computed_blocks is not None and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        return tuple(
            m.allocate(req_id, num_tokens, hit) for m, hit in zip(self.managers, hits, strict=True)
        )

    def cache_full_blocks(self, request: Request) -> None:
        """Commit the request's blocks that are now full of computed tokens."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        req_id = request.request_id
        if all(num_full <= m.num_cached_blocks.get(req_id, num_full) for m in self.managers):
            return
        hashes = self._update_block_hashes(request, num_full)
        for m in self.managers:
            m.cache_full_blocks(req_id, hashes, num_full)

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks in every group (no-op if it holds none).

        The tail goes into the free queue first, so it is evicted before the prefix,
        which other requests are likelier to share.
        """
        for m in self.managers:
            m.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The first group's block table as block ids (a live list: copy it to keep it)."""
        return self.managers[0].req_to_block_ids.get(request_id, [])

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Every group's block table as block ids (live lists: copy them to keep them)."""
        return tuple(m.req_to_block_ids.get(request_id, []) for m in self.managers)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (nothing done) while any block is in use."""
        if any(m.pool.num_free_blocks != m.pool.num_blocks - 1 for m in self.managers):
            return False
        return all([m.pool.reset_prefix_cache() for m in self.managers])
