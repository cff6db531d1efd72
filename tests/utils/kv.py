"""Helpers for tests that look inside paged KV caches."""

from __future__ import annotations

import torch

from decodegraph.attention.backends.base import AttentionBackend


def changed_slots(old: torch.Tensor, new: torch.Tensor) -> list[int]:
    """Slots (block * block_size + offset) whose row differs between two copies of one
    layer's K or V cache, in ascending order."""
    tokens_old, tokens_new = AttentionBackend.token_view(old), AttentionBackend.token_view(new)
    changed = (tokens_old != tokens_new).flatten(0, 1).any(-1).any(-1)
    return changed.nonzero().flatten().tolist()
