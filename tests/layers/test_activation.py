"""Gated activation of a stacked gate_up output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decodegraph.layers.activation import get_act_and_mul_fn
from decodegraph.platforms.base import trace
from decodegraph.platforms.cpu import CpuPlatform


def test_silu_and_mul_gates_the_second_half_with_the_first() -> None:
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    out = get_act_and_mul_fn("silu")(torch.cat((gate, up), dim=-1))
    torch.testing.assert_close(out, F.silu(gate) * up)


def test_unsupported_activation_is_refused_by_name() -> None:
    with pytest.raises(NotImplementedError, match="'gelu' is not supported"):
        get_act_and_mul_fn("gelu")


def test_the_native_silu_and_mul_matches_torch_on_strided_rows(cpu_ops: object) -> None:
    """Rows of 40 (two vectors and a masked tail), gates far out in both tails too."""
    wide = torch.randn(7, 2 * 40 + 3) * 4
    wide[0, :6] = torch.tensor([-200.0, -90.0, -87.5, 88.5, 95.0, 300.0])
    x = wide[:, : 2 * 40]
    want = F.silu(x[:, :40]) * x[:, 40:]
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), want, rtol=1e-6, atol=1e-6)


def test_silu_and_mul_runs_the_native_operator_eagerly_and_aten_ops_in_a_graph(
    cpu_ops: object,
) -> None:
    act, x = get_act_and_mul_fn("silu"), torch.randn(5, 32)
    with torch.profiler.profile() as prof:
        act(x)
    assert "decodegraph_cpu::silu_and_mul" in {e.name for e in prof.events()}
    gm = trace(lambda a: act(a), [x], CpuPlatform().graph_decompositions())
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("decodegraph_cpu" in t for t in targets), targets
    torch.testing.assert_close(gm(x), act(x), rtol=1e-6, atol=1e-6)
