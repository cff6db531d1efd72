"""RMSNorm with an optional fused residual add (vLLM's calling convention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodegraph.layers.triton_ops import fused_ops_for


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    `forward(x)` returns the normed tensor; `forward(x, residual)` first adds the
    residual and returns `(normed, x + residual)`, so a decoder layer carries its
    residual stream without a separate add per sub-block (vLLM's convention).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        # torch.empty: the loader (or dummy init) writes every weight; no init cost.
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.variance_epsilon = eps
        self.hidden_size = hidden_size

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = fused_ops_for(x) if x.dim() == 2 else None
        if ops is not None:  # one pass per row (CPU graph traces decompose it again)
            if residual is None:
                return ops.rms_norm(x, self.weight, self.variance_epsilon)
            return ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        if residual is not None:
            x = x + residual
            residual = x
        # F.rms_norm computes in float32 for half inputs, as transformers' LlamaRMSNorm does,
        # and is one call instead of six.
        out = F.rms_norm(x, (self.hidden_size,), self.weight, self.variance_epsilon)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
