"""The one explicit piece of global state: what the current forward pass attends with."""

from __future__ import annotations

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


class set_forward_context:  # noqa: N801 - used like the context-manager function it was
    """Make `ctx` current for the duration of a forward pass (or of a capture).

    A class rather than a generator-based context manager: it is entered once per step,
    and this costs a fifth as much."""

    __slots__ = ("_ctx", "_prev")

    def __init__(self, ctx: ForwardContext) -> None:
        self._ctx = ctx

    def __enter__(self) -> None:
        global _forward_context
        self._prev, _forward_context = _forward_context, self._ctx

    def __exit__(self, *exc: object) -> None:
        global _forward_context
        _forward_context = self._prev
