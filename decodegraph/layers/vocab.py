"""Token embedding and LM head, with vLLM's names, split by vocabulary rows over ranks.

Under tensor parallelism the vocabulary is padded to a multiple of the ranks and each
rank holds `padded / tp` consecutive rows (the padding rows, at the end, are zeros).
The embedding looks up the ids in its range, zeros the others, and one all-reduce sums
the ranks' rows; the LM head computes this rank's slice of the logits, all-gathers them
along the vocabulary and trims the padding. At tensor parallel size 1 both are the
plain lookup and matmul: no mask, no collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from decodegraph.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from decodegraph.layers.linear import read_weight


class VocabParallelEmbedding(nn.Module):
    """Token embedding table [num_embeddings, embedding_dim], this rank's rows of it
    ([num_embeddings_per_partition, embedding_dim]), uninitialised until loaded."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        self.num_embeddings = num_embeddings  # the real vocabulary
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size
        per_rank = self.num_embeddings_padded // self.tp_size
        self.num_embeddings_per_partition = per_rank
        self.full_weight_shape = (num_embeddings, embedding_dim)  # the checkpoint's
        # This rank's ids: [vocab_start_index, vocab_end_index), padding rows excluded.
        self.vocab_start_index = min(self.tp_rank * per_rank, num_embeddings)
        self.vocab_end_index = min(self.vocab_start_index + per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any) -> None:
        """Copy this rank's rows of the whole checkpoint table; zero the padding rows."""
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"shape mismatch: expected {expected}, checkpoint has {tuple(loaded_weight.shape)}"
            )
        start, rows = self.vocab_start_index, self.vocab_end_index - self.vocab_start_index
        param.data[:rows].copy_(read_weight(loaded_weight.narrow(0, start, rows)))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        start = self.vocab_start_index
        in_shard = (input_ids >= start) & (input_ids < start + self.num_embeddings_per_partition)
        rows = F.embedding(torch.where(in_shard, input_ids - start, 0), self.weight)
        rows = rows.masked_fill(~in_shard.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(rows)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the logits [N, per rank] put together into [N, vocab]
        (`logits` itself at tensor parallel size 1)."""
        if self.tp_size == 1:
            return logits
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        if self.num_embeddings_padded == self.num_embeddings:
            return logits
        return logits[..., : self.num_embeddings]

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"rows {self.vocab_start_index}:{self.vocab_end_index} of tp {self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; its weight has the embedding's shape."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 (the sampler's dtype), whatever the model dtype."""
        return self.gather_logits(F.linear(hidden_states, self.weight)).float()
