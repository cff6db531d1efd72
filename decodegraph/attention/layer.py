"""The `Attention` module models call, and the custom ops that graphs split at.

A model's forward sees `Attention` as a plain module taking q, k, v of shape
[num_tokens, heads * head_size]. Inside, it calls one opaque op that writes this step's
K/V into the layer's paged cache and attends over each request's context:
`torch.ops.decodegraph.unified_attention` (returns its output; full graphs and eager
steps), or `unified_attention_with_output` (writes an output tensor allocated before it:
what a piecewise trace splits at, so that the output lives in the piece before the
attention and stays at one address from replay to replay). Being one opaque op is what
lets the graph machinery trace the model around it (full graphs keep the op inside;
piecewise graphs split the trace at it and run it eagerly).

The op finds its metadata and KV cache at run time (by layer index and by the
graph-params id the forward context names), like vLLM's layer-name lookup: the KV
cache is never a graph input, so a compiled graph never copies it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodegraph.attention.backends.base import explicit_attention
from decodegraph.forward_context import get_forward_context

# Defined with torch.library.Library rather than custom_op: its dispatch costs less,
# which matters with one call per layer per step at batch 1 (docs/performance.md).
_lib = torch.library.Library("decodegraph", "DEF")
_lib.define(
    "unified_attention(Tensor query, Tensor key, Tensor value, int layer_idx, int params_id)"
    " -> Tensor"
)
_lib.define(
    "unified_attention_with_output(Tensor query, Tensor key, Tensor value, Tensor(a!) output,"
    " int layer_idx, int params_id) -> ()"
)


def unified_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, params_id: int
) -> torch.Tensor:
    """Write K/V into layer `layer_idx`'s cache and attend, with the attention params
    `params_id` (baked into a graph; refreshed by update_graph_params)."""
    output = query.new_empty(query.shape)
    get_forward_context().backend_of(layer_idx).forward(
        query, key, value, output, layer_idx, params_id
    )
    return output


def unified_attention_with_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_idx: int,
    params_id: int,
) -> None:
    """`unified_attention` into `output` ([num_tokens, heads * head_size], contiguous)."""
    get_forward_context().backend_of(layer_idx).forward(
        query, key, value, output, layer_idx, params_id
    )


_lib.impl("unified_attention", unified_attention, "CompositeExplicitAutograd")
# Shapes only (traces and fake tensors): the output is the query's shape.
_lib.impl("unified_attention", lambda query, *_: torch.empty_like(query), "Meta")
_lib.impl(
    "unified_attention_with_output", unified_attention_with_output, "CompositeExplicitAutograd"
)
_lib.impl("unified_attention_with_output", lambda *_: None, "Meta")

# The op a piecewise trace is split at.
SPLIT_OP = torch.ops.decodegraph.unified_attention_with_output.default


class Attention(nn.Module):
    """Paged attention for one decoder layer ([T, H*D] in, [T, H*D] out).

    `sliding_window` (a token sees the last W positions up to its own) and
    `logits_soft_cap` (scores capped as cap * tanh(s / cap)) make the layer's attention
    group: the model runner gives every group its own backend and KV cache.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx is None:
            # No engine around (a model used on its own): one causal sequence, no cache.
            return self._causal_attention(q, k, v)
        if ctx.split_attention:
            output = q.new_empty(q.shape)
            torch.ops.decodegraph.unified_attention_with_output(
                q, k, v, output, self.layer_idx, ctx.params_id
            )
            return output
        direct = ctx.backend_of(self.layer_idx).native_op_args(self.layer_idx, ctx.params_id)
        if direct is not None:
            op, args = direct
            return op(q, k, v, *args)
        return torch.ops.decodegraph.unified_attention(q, k, v, self.layer_idx, ctx.params_id)

    def _causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[0]
        qh = q.view(t, self.num_heads, self.head_size).transpose(0, 1)
        kh = k.view(t, self.num_kv_heads, self.head_size).transpose(0, 1)
        vh = v.view(t, self.num_kv_heads, self.head_size).transpose(0, 1)
        if self.sliding_window is None and self.logits_soft_cap is None:
            out = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            positions = torch.arange(t, device=q.device)
            out = explicit_attention(
                qh, kh, vh, self.scale, positions, self.logits_soft_cap, self.sliding_window
            )
        return out.transpose(0, 1).reshape(t, self.num_heads * self.head_size)
