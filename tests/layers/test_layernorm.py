"""RMSNorm against transformers' LlamaRMSNorm, and the fused residual add."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from decodegraph.layers.layernorm import RMSNorm
from decodegraph.platforms.base import trace
from decodegraph.platforms.cpu import CpuPlatform


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rmsnorm_matches_transformers(dtype: torch.dtype, tol: float) -> None:
    ours, theirs = RMSNorm(48, eps=1e-5), LlamaRMSNorm(48, eps=1e-5)
    weight = torch.rand(48) + 0.5
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = torch.randn(5, 48, dtype=dtype) * 3
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=tol, rtol=tol)


def test_fused_residual_returns_norm_of_sum_and_the_sum() -> None:
    norm = RMSNorm(16)
    norm.weight.data.fill_(1.0)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual))


@pytest.mark.parametrize("hidden", [64, 48, 7])
def test_the_native_norm_operators_match_torch(cpu_ops: object, hidden: int) -> None:
    """Strided rows (a view into a wider tensor) included."""
    wide = torch.randn(9, hidden + 5) * 3
    x, residual, weight = wide[:, :hidden], torch.randn(9, hidden), torch.rand(hidden) + 0.5
    torch.testing.assert_close(
        cpu_ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (hidden,), weight, 1e-5)
    )
    out, res = cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(res, x + residual)
    torch.testing.assert_close(out, F.rms_norm(x + residual, (hidden,), weight, 1e-5))


def test_rmsnorm_runs_the_native_operator_eagerly_and_aten_ops_in_a_graph(
    cpu_ops: object,
) -> None:
    norm = RMSNorm(16)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    with torch.profiler.profile() as prof:
        norm(x, residual)
    assert "decodegraph_cpu::fused_add_rms_norm" in {e.name for e in prof.events()}
    gm = trace(lambda a, b: norm(a, b), [x, residual], CpuPlatform().graph_decompositions())
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("decodegraph_cpu" in t for t in targets), targets
    for got, want in zip(gm(x, residual), norm(x, residual), strict=True):
        torch.testing.assert_close(got, want)
