"""Gated activations for fused gate/up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodegraph.layers.triton_ops import fused_ops_for


class SiluAndMul(nn.Module):
    """`silu(x[..., :d]) * x[..., d:]` for the output of a stacked gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops_for(x) if x.dim() == 2 else None
        if ops is not None:  # one pass (CPU graph traces decompose it again)
            return ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluTanhAndMul(nn.Module):
    """`gelu(x[..., :d], tanh approximation) * x[..., d:]` (Gemma's gated MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def get_act_and_mul_fn(hidden_act: str) -> nn.Module:
    """The gated activation for a config's `hidden_act` (silu, gelu_pytorch_tanh)."""
    if hidden_act not in _ACTIVATIONS:
        raise NotImplementedError(
            f"hidden_act {hidden_act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[hidden_act]()
