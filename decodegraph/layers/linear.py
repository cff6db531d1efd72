"""Linear layers whose weights are written by the loader, with vLLM's names.

Tensor parallel size is 1 in this release, so every layer holds the full matrix;
the classes mark where column/row splitting goes when it comes (docs/design.md §8). Weights
are allocated with `torch.empty` (no random init: the loader writes every one), and
stacked layers (q/k/v, gate/up) expose a `weight_loader(param, loaded_weight, shard_id)`
that copies one Hugging Face tensor into its rows of the stacked parameter.

After loading, `process_weights_after_loading` (vLLM's name for the hook) keeps each
weight's transpose as a view, so that a forward is one `mm` (or `addmm`): `F.linear`
dispatches linear -> t -> matmul -> mm, a large share of a small call at batch 1, where
a step makes several calls per layer. The weights must then be changed in place only (as
the loader does), never replaced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into `param` (dtype and device converted)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


class ReplicatedLinear(nn.Module):
    """`y = x W^T (+ b)` with an uninitialised weight of shape [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # Inference only: no autograd bookkeeping on any op that touches the weights.
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        # weight.t(), a view set once the weights are loaded (None before).
        self.weight_t: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        self.weight_t = self.weight.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight_t = self.weight_t
        if weight_t is None or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, weight_t)
        return torch.addmm(self.bias, x, weight_t)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class RowParallelLinear(ReplicatedLinear):
    """Output projection (o_proj, down_proj); split by rows under tensor parallelism."""


class MergedColumnParallelLinear(ReplicatedLinear):
    """Several projections of the same input stacked by rows (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        """(offset, size) of shard `shard_id` in the stacked rows."""
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str
    ) -> None:
        """Copy one shard's checkpoint tensor (weight or bias) into its rows of `param`."""
        offset, size = self.shard_range(shard_id)  # type: ignore[arg-type]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded_weight.shape:
            raise ValueError(
                f"shape mismatch for shard {shard_id!r}: expected {tuple(target.shape)}, "
                f"checkpoint has {tuple(loaded_weight.shape)}"
            )
        target.copy_(loaded_weight)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections stacked by rows: [Hq*D + Hkv*D + Hkv*D, hidden]."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        self.q_size = total_num_heads * head_size
        self.kv_size = total_num_kv_heads * head_size
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        index = {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id
        return super().shard_range(index)
