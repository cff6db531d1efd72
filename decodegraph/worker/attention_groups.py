"""A model's attention groups: its layers by the kind of attention they run.

Layers with the same sliding window (or none) form one group: one attention backend
(its window, soft-cap and scale), one KV cache group (kv_cache_spec.py) with its own
block tables, and its own metadata and graph params, found by the group's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodegraph.attention.backends.base import AttentionBackend
from decodegraph.attention.layer import Attention
from decodegraph.core.kv_cache_spec import KVCacheGroupSpec, SlidingWindowSpec, kv_cache_groups


@dataclass
class AttentionGroups:
    """The groups of one model, in the order of their first layer."""

    # Per group: its KV cache spec and layers.
    kv_cache_groups: list[KVCacheGroupSpec]
    # Group name -> its backend.
    backends: dict[str, AttentionBackend]
    # Layer index -> the backend of its group.
    layer_backends: list[AttentionBackend]

    @property
    def first(self) -> AttentionBackend:
        return self.layer_backends[0]


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    """The model's attention layers by layer index (every index from 0 exactly once)."""
    layers = sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
    )
    if [m.layer_idx for m in layers] != list(range(len(layers))):
        raise ValueError("model: its Attention layers must be numbered 0, 1, ... once each")
    return layers


def build_attention_groups(
    model: torch.nn.Module,
    backend_cls: type[AttentionBackend],
    block_size: int,
    max_model_len: int,
) -> AttentionGroups:
    """One backend per group of `model`'s attention layers."""
    layers = attention_layers(model)
    groups = kv_cache_groups(block_size, [m.sliding_window for m in layers], max_model_len)
    backends: dict[str, AttentionBackend] = {}
    layer_backends: list[AttentionBackend | None] = [None] * len(layers)
    for group in groups:
        members = [layers[i] for i in group.layer_indices]
        first = members[0]
        for m in members[1:]:
            if (m.num_heads, m.num_kv_heads, m.head_size, m.scale, m.logits_soft_cap) != (
                first.num_heads,
                first.num_kv_heads,
                first.head_size,
                first.scale,
                first.logits_soft_cap,
            ):
                raise ValueError(
                    f"model: layers {first.layer_idx} and {m.layer_idx} share a sliding window "
                    "but not their heads, scale or soft-cap (one attention group each)"
                )
        window = group.spec.sliding_window if isinstance(group.spec, SlidingWindowSpec) else None
        backend = backend_cls(
            first.num_heads,
            first.num_kv_heads,
            first.head_size,
            first.scale,
            block_size,
            max_model_len,
            sliding_window=window,
            logits_soft_cap=first.logits_soft_cap,
        )
        backends[group.name] = backend
        for i in group.layer_indices:
            layer_backends[i] = backend
    return AttentionGroups(groups, backends, layer_backends)  # type: ignore[arg-type]
