"""The `Attention` module models call, and the custom op that graphs split at.

A model's forward sees `Attention` as a plain module taking q, k, v of shape
[num_tokens, heads * head_size]. Inside, it calls one opaque op,
`torch.ops.decodegraph.unified_attention`, that writes this step's K/V into the
layer's paged cache and attends over each request's context. Being one opaque op
is what lets the graph machinery trace the model around it (full graphs keep the
op inside; piecewise graphs split the trace at it and run it eagerly).

The op finds its metadata and KV cache at run time (by layer index and by the
graph-params slot the forward context names), like vLLM's layer-name lookup: the
KV cache is never a graph input, so a compiled graph never copies it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodegraph.attention.forward_context import get_forward_context

# Defined with torch.library.Library rather than custom_op: its dispatch costs a
# quarter as much, which matters with one call per layer per step at batch 1.
_lib = torch.library.Library("decodegraph", "DEF")
_lib.define(
    "unified_attention(Tensor query, Tensor key, Tensor value, int layer_idx, int slot) -> Tensor"
)


def unified_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, slot: int
) -> torch.Tensor:
    """Write K/V into layer `layer_idx`'s cache and attend, with the metadata in
    graph-params slot `slot` (baked into a graph; refreshed by update_graph_params)."""
    return get_forward_context().attn_backend.forward(query, key, value, layer_idx, slot)


def _unified_attention_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, slot: int
) -> torch.Tensor:
    return torch.empty_like(query)


_lib.impl("unified_attention", unified_attention, "CompositeExplicitAutograd")
_lib.impl("unified_attention", _unified_attention_fake, "Meta")


class Attention(nn.Module):
    """Paged attention for one decoder layer ([T, H*D] in, [T, H*D] out)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx is None:
            # No engine around (a model used on its own): one causal sequence, no cache.
            return self._causal_attention(q, k, v)
        if not ctx.split_attention:
            direct = ctx.attn_backend.native_op_args(self.layer_idx, ctx.params_slot)
            if direct is not None:
                op, args = direct
                return op(q, k, v, *args)
        return torch.ops.decodegraph.unified_attention(q, k, v, self.layer_idx, ctx.params_slot)

    def _causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[0]
        qh = q.view(t, self.num_heads, self.head_size).transpose(0, 1)
        kh = k.view(t, self.num_kv_heads, self.head_size).transpose(0, 1)
        vh = v.view(t, self.num_kv_heads, self.head_size).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True
        )
        return out.transpose(0, 1).reshape(t, self.num_heads * self.head_size)
