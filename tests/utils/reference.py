"""transformers on the same weights: the numerical reference of the logprob tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def transformers_logprobs(model_dir: Path) -> Callable[[list[int]], torch.Tensor]:
    """A function giving transformers' log-softmax over the vocabulary at every position
    of a sequence of token ids ([len(ids), vocab], float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs
