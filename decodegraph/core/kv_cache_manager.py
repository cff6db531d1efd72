"""Per-request block tables over the block pool, with prefix caching.

The scheduler asks three things of it: which of a new request's leading blocks are
already cached (`get_computed_blocks`), room for the tokens it is about to schedule
(`allocate_slots`, None when the cache is full), and to give a request's blocks back
(`free`). After a step computed tokens, `cache_full_blocks` commits the blocks that
became full so later requests with the same prefix can reuse them.
"""

from __future__ import annotations

from decodegraph.core.block_pool import ROOT_BLOCK_HASH, BlockPool, KVCacheBlock, hash_block_tokens
from decodegraph.request import Request


class KVCacheManager:
    """Block tables of the running requests and the prefix-cache bookkeeping."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # request id -> its blocks, in token order (the block table).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> the same table as block ids, kept in step so reading a table
        # does not rebuild it every step.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # request id -> how many of its leading blocks are committed to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics in tokens, counted once per admitted lookup.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, cached-but-unused ones included)."""
        return self.block_pool.num_free_blocks

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

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached full blocks that prefixes the request's tokens.

        Returns the blocks and the number of tokens they hold. At least one token is
        always left to compute, because the last token's forward produces the logits
        to sample from. The blocks are not referenced yet: pass them to
        `allocate_slots` before any other allocation.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._update_block_hashes(request, max_blocks)
        get_cached_block = self.block_pool.get_cached_block
        computed: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = get_cached_block(hashes[i])
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` for a
        request being admitted (pass [] for an admission without hits, so the lookup is
        counted in the statistics); `request.num_computed_tokens` must not include
        them yet. Returns the newly allocated blocks, or None (and changes nothing)
        when too few blocks are free.
        """
        req_id = request.request_id
        bs = self.block_size
        blocks = self.req_to_blocks.get(req_id)
        if (
            new_computed_blocks is None
            and blocks is not None
            and request.num_computed_tokens + num_new_tokens <= len(blocks) * bs
        ):
            return []  # a running request whose tokens fit in its blocks (most decode steps)
        num_existing = len(blocks) if blocks is not None else 0
        num_hit = len(new_computed_blocks) if new_computed_blocks else 0
        num_tokens_needed = request.num_computed_tokens + num_hit * bs + num_new_tokens
        num_required = -(-num_tokens_needed // bs) - num_existing - num_hit

        pool = self.block_pool
        if num_hit:
            # Hits sitting in the free queue stop being allocatable once referenced.
            num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)  # type: ignore[union-attr]
        else:
            num_evictable_hits = 0
        if num_required + num_evictable_hits > pool.num_free_blocks:
            return None

        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self.req_to_block_ids[req_id] = []
            self.num_cached_blocks[req_id] = 0
        block_ids = self.req_to_block_ids[req_id]
        if new_computed_blocks is not None:
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit * bs
            if num_hit:
                pool.touch(new_computed_blocks)
                blocks.extend(new_computed_blocks)
                block_ids.extend(b.block_id for b in new_computed_blocks)
                # Hits are committed already: skip them in cache_full_blocks.
                self.num_cached_blocks[req_id] = len(blocks)
        if num_required <= 0:
            return []
        new_blocks = pool.get_new_blocks(num_required)
        blocks.extend(new_blocks)
        block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def cache_full_blocks(self, request: Request) -> None:
        """Commit the request's blocks that are now full of computed tokens."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        num_cached = self.num_cached_blocks.get(req_id)
        if num_cached is None or num_full <= num_cached:
            return
        blocks = self.req_to_blocks[req_id]
        num_full = min(num_full, len(blocks))
        hashes = self._update_block_hashes(request, num_full)
        self.block_pool.cache_full_blocks(blocks, hashes, num_cached, num_full)
        self.num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks (no-op if it holds none).

        The tail goes into the free queue first, so it is evicted before the prefix,
        which other requests are likelier to share.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks is None:
            return
        del self.req_to_block_ids[req_id]
        del self.num_cached_blocks[req_id]
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (a live list: copy it to keep it)."""
        return self.req_to_block_ids.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()
