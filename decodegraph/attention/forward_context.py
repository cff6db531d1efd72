"""The one explicit piece of global state: what the current forward pass attends with."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decodegraph.attention.backends.base import AttentionBackend


@dataclass
class ForwardContext:
    # The backend that owns the KV caches and the graph-params slots.
    attn_backend: AttentionBackend
    # Which graph-params slot the attention op reads: the eager slot, or the slot of
    # the graph being captured (baked into it, refreshed before each replay).
    params_slot: int
    # A piecewise capture: attention must stay the op the trace is split at (run
    # eagerly with each step's metadata), never a native operator called directly with
    # this capture's metadata tensors baked in.
    split_attention: bool = False


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext | None:
    """The context of the forward pass now running, or None outside the engine."""
    return _forward_context


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Make `ctx` current for the duration of a forward pass (or of a capture)."""
    global _forward_context
    prev, _forward_context = _forward_context, ctx
    try:
        yield
    finally:
        _forward_context = prev
