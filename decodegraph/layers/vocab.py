"""Token embedding and LM head, with vLLM's names (tensor parallel size 1 for now)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    """Token embedding table [num_embeddings, embedding_dim], uninitialised until loaded."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; its weight has the embedding's shape."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits in float32 (the sampler's dtype), whatever the model dtype."""
        return F.linear(hidden_states, self.weight).float()
