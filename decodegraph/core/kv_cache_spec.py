"""What the KV cache of a group of layers needs (vLLM's KV cache specs), and the groups.

A model's attention layers fall into KV cache groups by the kind of attention they run:
full attention keeps every position; sliding-window attention over a window of W
positions needs only the blocks that still hold one of the last W - 1 positions before
the next token, and frees the others. Each group has its own blocks (its own pool and
block tables), so a sliding group's memory stays O(W) per request while the full
group's grows with the context.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttentionSpec:
    """Every position of a request stays in the cache."""

    block_size: int


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A token attends to the last `sliding_window` positions up to its own."""

    block_size: int
    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be at least 1, got {self.sliding_window}")

    @property
    def window_blocks(self) -> int:
        """Blocks that hold the W - 1 positions before a token (the window, less the
        token itself), counted as vLLM does: cdiv(W - 1, block_size)."""
        return -(-(self.sliding_window - 1) // self.block_size)

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """The first block the next token's window reaches: those before it are freed."""
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its name (the attention group's), its spec and its layers."""

    name: str
    spec: KVCacheSpec
    layer_indices: tuple[int, ...]


def full_attention_groups(block_size: int, num_layers: int) -> list[KVCacheGroupSpec]:
    """The one group of a model whose every layer runs full attention."""
    return [
        KVCacheGroupSpec("full_attention", FullAttentionSpec(block_size), tuple(range(num_layers)))
    ]


def kv_cache_groups(
    block_size: int, layer_windows: list[int | None], max_model_len: int
) -> list[KVCacheGroupSpec]:
    """Groups for layers with these sliding windows (None: full attention), in layer
    order of their first layer. A window at least `max_model_len` long is full attention:
    no request ever reaches past it."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        key = window if window is not None and window < max_model_len else None
        by_window.setdefault(key, []).append(layer)
    groups = []
    for window, layers in by_window.items():
        if window is None:
            groups.append(
                KVCacheGroupSpec("full_attention", FullAttentionSpec(block_size), tuple(layers))
            )
        else:
            name = "sliding_attention" if len(by_window) <= 2 else f"sliding_attention_{window}"
            groups.append(
                KVCacheGroupSpec(name, SlidingWindowSpec(block_size, window), tuple(layers))
            )
    return groups
