"""The pool of KV-cache blocks: reference counts, the free queue and the prefix cache.

A block is `block_size` token slots of K/V in every layer. Block 0 is the null block:
it is never handed out, so padded rows of a graph batch can point at it without
touching a real request's cache.

Prefix caching keeps a block's contents findable after its last user frees it: a
full block carries a hash chained from the first block of its sequence, and a block
whose reference count drops to 0 keeps that hash while it waits in the free queue. The
free queue is LRU: blocks are taken from its front (least recently freed first) and
the hash of a block taken for reuse is dropped from the cache then, not earlier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Parent hash of a sequence's first block. A fixed int rather than None because
# hash(None) differs between processes before Python 3.12.
ROOT_BLOCK_HASH = 0


def hash_block_tokens(parent_block_hash: int, block_token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: its parent's hash and its own token ids."""
    return hash((parent_block_hash, tuple(block_token_ids)))


class KVCacheBlock:
    """One block of the paged KV cache as the pool tracks it."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Requests whose block table holds this block.
        self.ref_cnt = 0
        # Set once the block is full and committed to the prefix cache; kept while the
        # block is free so a later request can reuse its K/V, dropped on eviction.
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """All blocks of the KV cache, the LRU free queue and the hash -> block map.

    Every operation costs O(blocks touched): the free queue is an `OrderedDict` keyed
    by block id, so taking from the front, appending at the back and removing a cached
    block that a new request hits are all O(1).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks: need at least 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # Never freed: a reference count of 1 that nobody drops keeps it out of the queue.
        self.null_block.ref_cnt = 1
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references (cached ones included: they are evictable)."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) that are referenced."""
        return 1.0 - len(self.free_block_queue) / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """The block holding the full block with this chained hash, if cached."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the front of the free queue, evicting their hashes.

        Raises ValueError when fewer are free; callers check `num_free_blocks` first.
        """
        if num_blocks > len(self.free_block_queue):
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, only {len(self.free_block_queue)} free"
            )
        popitem = self.free_block_queue.popitem
        new_blocks = []
        for _ in range(num_blocks):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        # Only drop the map entry if it is this block: a duplicate of the same contents
        # is never mapped (see cache_full_blocks), but be exact about ownership.
        if self.cached_block_hash_to_block.get(block_hash) is block:  # type: ignore[arg-type]
            del self.cached_block_hash_to_block[block_hash]  # type: ignore[arg-type]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to prefix-cache hits, pulling free ones out of the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                del queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks that reach 0 join the free queue.

        Pass blocks in eviction order (first is evicted first). A block with no hash
        holds nothing reusable, so it goes to the front of the queue, where it is taken
        before any cached block.
        """
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue[block.block_id] = block
                if block.block_hash is None:
                    queue.move_to_end(block.block_id, last=False)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int], start: int, end: int
    ) -> None:
        """Commit blocks[start:end] (full, computed) to the prefix cache under their hashes.

        If another block already holds the same contents (two requests computed the
        same block at once), the existing one stays the cached copy and this one stays
        unhashed, so it is recycled first once freed.
        """
        if not self.enable_caching:
            return
        cache = self.cached_block_hash_to_block
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix-cache hit, already committed
            block_hash = block_hashes[i]
            if block_hash not in cache:
                cache[block_hash] = block
                block.block_hash = block_hash

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only done when no block is in use (returns success)."""
        if len(self.free_block_queue) != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
