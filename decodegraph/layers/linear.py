"""Linear layers whose weights are written by the loader, with vLLM's names and sharding.

Under tensor parallelism (docs/design.md §8) each rank holds a slice of a matrix:
column-parallel layers (q/k/v, gate/up) split the output rows, and their outputs stay
split; row-parallel layers (o_proj, down_proj) split the input columns, and their
partial outputs are summed by one all-reduce, after which the bias is added once.
Attention heads are split whole: each rank holds `num_heads / tp` query heads and
`num_kv_heads / tp` KV heads, or, with more ranks than KV heads, one KV head shared by
`tp / num_kv_heads` ranks (vLLM's KV head replication). At tensor parallel size 1 every
layer holds the full matrix and runs exactly as it did before sharding existed: one
`mm`/`addmm`, no collective.

Weights are allocated with `torch.empty` (no random init: the loader writes every one).
A layer's `weight_loader(param, loaded_weight[, shard_id])` takes the whole checkpoint
tensor, or a lazy slice of it (anything with `.shape`, `.narrow()` and `.read()`, see
models/weights.py), and narrows it to this rank's part before reading it, so that no
rank reads what it does not hold.

After loading, `process_weights_after_loading` (vLLM's name for the hook) keeps each
weight's transpose as a view, so that a forward is one `mm` (or `addmm`): `F.linear`
dispatches linear -> t -> matmul -> mm, a large share of a small call at batch 1, where
a step makes several calls per layer. The weights must then be changed in place only (as
the loader does), never replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from decodegraph.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from decodegraph.native import load_cpu_ops


def read_weight(loaded_weight: Any) -> torch.Tensor:
    """The tensor of a checkpoint weight: itself, or what a lazy slice reads."""
    return loaded_weight if isinstance(loaded_weight, torch.Tensor) else loaded_weight.read()


def default_weight_loader(param: nn.Parameter, loaded_weight: Any) -> None:
    """Copy a whole checkpoint tensor into `param` (dtype and device converted)."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(read_weight(loaded_weight))


def divide(size: int, tp_size: int, what: str) -> int:
    """`size / tp_size`; ValueError naming `tensor_parallel_size` and `what` when the
    ranks cannot split it evenly."""
    if size % tp_size:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must divide {what} ({size})")
    return size // tp_size


def attention_heads_per_rank(
    total_num_heads: int, total_num_kv_heads: int, tp_size: int
) -> tuple[int, int]:
    """(query heads, KV heads) each of `tp_size` ranks holds. With more ranks than KV
    heads, each rank holds one KV head, shared by `tp_size / total_num_kv_heads` ranks."""
    num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
    if tp_size < total_num_kv_heads:
        return num_heads, divide(total_num_kv_heads, tp_size, "num_key_value_heads")
    if tp_size % total_num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must divide num_key_value_heads "
            f"({total_num_kv_heads}) or be a multiple of it"
        )
    return num_heads, 1


def _tp(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    """This rank and group size, unless given (tests build one rank's shard in-process)."""
    rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    return rank, size


# Weights smaller than this keep mm: a compiled graph inlines a small one-row product
# into its own loops, cheaper than an operator call (docs/performance.md).
_ONE_ROW_MIN_NUMEL = 1 << 16


# At most this many rows go through the CPU operators' few-rows product (a small decode
# batch: the default CPU graphs' 4 and 8 rows, or fewer); more go to BLAS.
FEW_ROWS_MAX = 8


def few_rows_linear(weight: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """`f(x [m, k], weight [n, k], bias | None) -> [m, n]` for 2 <= m <= FEW_ROWS_MAX,
    the CPU operators' few-rows product, where the batch-1 one applies (one_row_linear:
    float32 or bfloat16 on CPU, operators built, at least _ONE_ROW_MIN_NUMEL values): it
    reads the weight once for all the rows, where BLAS repacks it on every call at so
    few rows and reads it at a fraction of the bandwidth (docs/performance.md). None
    elsewhere: mm."""
    return None if one_row_linear(weight) is None else load_cpu_ops().linear_few_rows


def one_row_linear(weight: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """`f(x [1, k], weight [n, k], bias | None) -> [1, n]`, the CPU operators' batch-1
    projection, where it applies to `weight` (float32 or bfloat16 on CPU, operators built,
    at least _ONE_ROW_MIN_NUMEL values): it spreads the weight reads over the intra-op
    threads, where BLAS keeps one row on one thread (docs/performance.md). x and bias
    are of the weight's dtype, and so is the output (bfloat16 sums in float32). None
    elsewhere: mm."""
    if weight.numel() < _ONE_ROW_MIN_NUMEL or weight.device.type != "cpu":
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    ops = load_cpu_ops()
    return None if ops is None else ops.linear_one_row


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
        # The batch-1 and few-rows projections (one_row_linear, few_rows_linear), set
        # once the weights are loaded.
        self.one_row: Callable[..., torch.Tensor] | None = None
        self.few_rows: Callable[..., torch.Tensor] | None = None

    def process_weights_after_loading(self) -> None:
        self.weight_t = self.weight.t()
        self.one_row = one_row_linear(self.weight)
        self.few_rows = few_rows_linear(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T (+ bias)` by the cheapest call: one mm or addmm on the weight's
        transposed view, the batch-1 operator for one row and the few-rows one for up to
        FEW_ROWS_MAX, F.linear before loading."""
        weight_t = self.weight_t
        if weight_t is None or x.dim() != 2:
            return F.linear(x, self.weight, bias)
        rows = x.shape[0]
        if isinstance(rows, int):
            one, few = rows == 1, 1 < rows <= FEW_ROWS_MAX
        else:
            # Symbolic rows (the dynamic decode graph's trace): the one-row and few-rows
            # calls only where every row count the trace covers takes them.
            one = statically_known_true(rows == 1)
            few = statically_known_true(rows > 1) and statically_known_true(rows <= FEW_ROWS_MAX)
        if self.one_row is not None and one:
            return self.one_row(x, self.weight, bias)
        if self.few_rows is not None and few:
            return self.few_rows(x, self.weight, bias)
        if bias is None:
            return torch.mm(x, weight_t)
        return torch.addmm(bias, x, weight_t)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ColumnParallelLinear(ReplicatedLinear):
    """`y = x W^T (+ b)` with W's output rows split over the ranks: this rank computes
    `output_size / tp` outputs (all of them, concatenated, with `gather_output`)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        *,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.tp_rank, self.tp_size = _tp(tp_rank, tp_size)
        name = type(self).__name__
        per_rank = divide(output_size, self.tp_size, f"the output size of {name}")
        super().__init__(input_size, per_rank, bias)
        self.output_size = output_size
        self.output_size_per_partition = per_rank
        self.full_weight_shape = (output_size, input_size)  # the checkpoint's, all ranks'
        self.gather_output = gather_output and self.tp_size > 1

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any) -> None:
        """Copy this rank's rows of the whole checkpoint tensor (weight or bias)."""
        n = self.output_size_per_partition
        if loaded_weight.shape[0] != self.output_size:
            raise ValueError(
                f"shape mismatch: expected {self.output_size} rows, checkpoint has "
                f"{tuple(loaded_weight.shape)}"
            )
        default_weight_loader(param, loaded_weight.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x, self.bias)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


class RowParallelLinear(ReplicatedLinear):
    """Output projection (o_proj, down_proj): W's input columns split over the ranks.

    Each rank multiplies its slice of the input features (what a column-parallel layer
    left on it, `input_is_parallel`) by its columns of W; with `reduce_results` one
    all-reduce sums the partial outputs, and the bias is added once, after it. Without
    it the caller sums, and only rank 0 adds the bias."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        *,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        if not input_is_parallel:
            raise NotImplementedError("RowParallelLinear takes an input already split by rank")
        self.tp_rank, self.tp_size = _tp(tp_rank, tp_size)
        name = type(self).__name__
        per_rank = divide(input_size, self.tp_size, f"the input size of {name}")
        super().__init__(per_rank, output_size, bias)
        self.input_size = input_size
        self.input_size_per_partition = per_rank
        self.full_weight_shape = (output_size, input_size)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any) -> None:
        """Copy this rank's columns of the weight; the bias whole."""
        if param.dim() == 2:
            if loaded_weight.shape[-1] != self.input_size:
                raise ValueError(
                    f"shape mismatch: expected {self.input_size} columns, checkpoint has "
                    f"{tuple(loaded_weight.shape)}"
                )
            n = self.input_size_per_partition
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * n, n)
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.product(x, self.bias)
        partial = self.product(x, None)  # the bias is added once, after the sum
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(partial)
        elif self.tp_rank == 0:
            out = partial
        else:
            return partial
        return out if self.bias is None else out + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stacked by rows (gate_proj
    + up_proj): each rank holds its slice of each, stacked in the same order."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.tp_rank, self.tp_size = _tp(tp_rank, tp_size)
        name = type(self).__name__
        for size in output_sizes:
            divide(size, self.tp_size, f"each output size of {name}")
        super().__init__(
            input_size, sum(output_sizes), bias, tp_rank=self.tp_rank, tp_size=self.tp_size
        )
        self.output_sizes = list(output_sizes)
        self.output_sizes_per_partition = [size // self.tp_size for size in output_sizes]

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        """(offset, size) of shard `shard_id` in this rank's stacked rows."""
        sizes = self.output_sizes_per_partition
        return sum(sizes[:shard_id]), sizes[shard_id]  # type: ignore[index]

    @property
    def full_output_sizes(self) -> list[int]:
        """Rows of each shard's checkpoint tensor (its output size on all ranks)."""
        return [self.checkpoint_range(i)[1] for i in range(len(self.output_sizes))]

    def checkpoint_range(self, shard_id: int | str) -> tuple[int, int]:
        """(first row, rows in all) of shard `shard_id`'s checkpoint tensor: this rank
        reads rows [first, first + size) of them."""
        _, size = self.shard_range(shard_id)
        return self.tp_rank * size, self.output_sizes[shard_id]  # type: ignore[index]

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: int | str) -> None:
        """Copy this rank's rows of one shard's checkpoint tensor (weight or bias) into
        that shard's rows of `param`."""
        offset, size = self.shard_range(shard_id)
        start, total = self.checkpoint_range(shard_id)
        expected = (total, *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"shape mismatch for shard {shard_id!r}: expected {expected}, "
                f"checkpoint has {tuple(loaded_weight.shape)}"
            )
        param.data.narrow(0, offset, size).copy_(read_weight(loaded_weight.narrow(0, start, size)))

    forward = ReplicatedLinear.forward  # outputs stay split: no gather, nothing extra


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections stacked by rows, split by head over the ranks: this rank's
    [num_heads*D + num_kv_heads*D + num_kv_heads*D, hidden] (`attention_heads_per_rank`;
    a KV head is replicated on several ranks when there are more ranks than KV heads)."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        *,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        tp_rank, tp_size = _tp(tp_rank, tp_size)
        self.num_heads, self.num_kv_heads = attention_heads_per_rank(
            total_num_heads, total_num_kv_heads, tp_size
        )
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_kv_head_replicas = max(1, tp_size // total_num_kv_heads)
        self.q_size = self.num_heads * head_size  # this rank's
        self.kv_size = self.num_kv_heads * head_size
        # The stacked layer of every rank's q/k/v sizes (a replicated KV head counted on
        # each rank that holds it), so that the sizes split evenly.
        super().__init__(
            hidden_size,
            [self.q_size * tp_size, self.kv_size * tp_size, self.kv_size * tp_size],
            bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        index = {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id
        return super().shard_range(index)

    def checkpoint_range(self, shard_id: int | str) -> tuple[int, int]:
        index = {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id
        if index == 0:
            return self.tp_rank * self.q_size, self.total_num_heads * self.head_size
        # Ranks r * replicas .. (r + 1) * replicas - 1 hold KV heads of slot r.
        slot = self.tp_rank // self.num_kv_head_replicas
        return slot * self.kv_size, self.total_num_kv_heads * self.head_size
