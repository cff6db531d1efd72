"""Stacked projections: each checkpoint tensor lands in its own rows."""

from __future__ import annotations

import pytest
import torch

from decodegraph.layers.linear import MergedColumnParallelLinear, QKVParallelLinear


def test_qkv_weight_loader_stacks_q_k_v_in_order() -> None:
    layer = QKVParallelLinear(
        hidden_size=8, head_size=4, total_num_heads=4, total_num_kv_heads=2, bias=True
    )
    q, k, v = torch.randn(16, 8), torch.randn(8, 8), torch.randn(8, 8)
    for shard, w in (("v", v), ("q", q), ("k", k)):  # checkpoint order does not matter
        layer.weight_loader(layer.weight, w, shard)
        layer.weight_loader(layer.bias, w[:, 0], shard)
    torch.testing.assert_close(layer.weight.data, torch.cat((q, k, v)))
    torch.testing.assert_close(layer.bias.data, torch.cat((q, k, v))[:, 0])
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), x @ torch.cat((q, k, v)).T + layer.bias)


def test_merged_weight_loader_rejects_a_wrong_shape() -> None:
    layer = MergedColumnParallelLinear(8, [6, 6])
    with pytest.raises(ValueError, match=r"shard 1.*expected \(6, 8\).*\(5, 8\)"):
        layer.weight_loader(layer.weight, torch.zeros(5, 8), 1)
