"""RMSNorm against transformers' LlamaRMSNorm, and the fused residual add."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from decodegraph.layers.layernorm import RMSNorm


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
