"""Stacked projections: each checkpoint tensor lands in its own rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decodegraph.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
)


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


@pytest.mark.parametrize("bias", [False, True])
def test_after_loading_a_forward_is_one_mm_with_the_bits_of_f_linear(bias: bool) -> None:
    layer = ReplicatedLinear(8, 6, bias)
    layer.weight.data.copy_(torch.randn(6, 8))
    if bias:
        layer.bias.data.copy_(torch.randn(6))
    x = torch.randn(5, 8)
    want = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), want)  # before the hook: F.linear itself
    layer.process_weights_after_loading()
    with torch.profiler.profile() as prof:
        out = layer(x)
    names = {e.name for e in prof.events()}
    assert "aten::linear" not in names and ("aten::addmm" if bias else "aten::mm") in names
    assert torch.equal(out, want)
    layer.weight.data.mul_(2)  # weights changed in place afterwards: still seen
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert torch.equal(layer(x[None]), F.linear(x[None], layer.weight, layer.bias))  # 3-D
