"""The one explicit piece of global state: what the current forward pass attends with,
per thread (a dynamic decode graph may be traced on a thread of its own while the
engine's thread steps: graphs/graph_runner.py).

Also the key a graph is stored under (`BatchDescriptor`): graphs (which capture and
dispatch by it) and attention (which builds metadata for it) both import this module,
and neither imports the other's internals for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from decodegraph.attention.backends.base import AttentionBackend

# The params id of eager steps: their attention metadata is rewritten every step.
EAGER_PARAMS_ID = 0


class BatchDescriptor(NamedTuple):
    """The key a graph is stored under (after padding)."""

    num_tokens: int
    # Requests in the batch; for uniform decode it equals num_tokens. Mixed-batch
    # graphs do not depend on it and store None.
    num_reqs: int | None
    # Every request adds exactly one token.
    uniform: bool
    # Decode steps one graph runs, each step's greedy ids the next one's tokens (a
    # multi-step graph, docs/design.md §3); 1 everywhere else.
    num_steps: int = 1

    def label(self) -> str:
        """The key as logs and errors print it: (num_tokens, num_reqs, uniform), then
        xN for a multi-step graph."""
        steps = f"x{self.num_steps}" if self.num_steps > 1 else ""
        return f"({self.num_tokens}, {self.num_reqs}, {self.uniform}){steps}"


@dataclass
class ForwardContext:
    # The backend that owns the KV caches and the attention metadata (of the first
    # attention group; `layer_backends` names each layer's where there are several).
    attn_backend: AttentionBackend
    # Which attention params the attention op reads: the eager ones (EAGER_PARAMS_ID),
    # or those of the graph being captured (an id baked into the graph; the graph
    # runner refreshes them before each replay with update_graph_params).
    params_id: int
    # A piecewise capture: attention must stay the op the trace is split at (run
    # eagerly with each step's metadata), never a native operator called directly with
    # this capture's metadata tensors baked in.
    split_attention: bool = False
    # Layer index -> the backend of its attention group; None: every layer's is
    # attn_backend.
    layer_backends: list[AttentionBackend] | None = None

    def backend_of(self, layer_idx: int) -> AttentionBackend:
        """The attention backend of layer `layer_idx`."""
        backends = self.layer_backends
        return self.attn_backend if backends is None else backends[layer_idx]


class _State(threading.local):
    context: ForwardContext | None = None


_state = _State()


def get_forward_context() -> ForwardContext | None:
    """The context of the forward pass now running on this thread, or None outside the
    engine."""
    return _state.context


class set_forward_context:  # noqa: N801 - used like the context-manager function it was
    """Make `ctx` current for the duration of a forward pass (or of a capture).

    A class rather than a generator-based context manager: it is entered once per step,
    and this costs much less."""

    __slots__ = ("_ctx", "_prev")

    def __init__(self, ctx: ForwardContext) -> None:
        self._ctx = ctx

    def __enter__(self) -> None:
        state = _state
        self._prev, state.context = state.context, self._ctx

    def __exit__(self, *exc: object) -> None:
        _state.context = self._prev
