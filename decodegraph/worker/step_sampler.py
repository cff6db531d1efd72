"""A step's sampling on one rank: the graph's argmax where it is the whole rule, else the
sampler; rank 0 samples for a tensor-parallel group and every rank gets its tokens."""

from __future__ import annotations

import torch

from decodegraph.distributed.parallel_state import TPGroup
from decodegraph.sample.metadata import BatchStaticsCache, SamplingMetadata
from decodegraph.sample.sampler import Sampler, SamplerOutput
from decodegraph.structured_output.manager import StructuredOutputManager
from decodegraph.worker.request_state import CachedRequestState


class StepSampler:
    """Samples each step's rows for the model runner. `structured_output` gives grammar
    requests their masks (None: no grammar requests)."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        tp_group: TPGroup,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.tp_group = tp_group
        self.structured_output = structured_output
        self.sampler = Sampler()
        # The previous batch's statics, reused while the same requests sit in its rows.
        self.statics = BatchStaticsCache()

    def metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        """The sampling metadata of `states`' rows (no grammar mask)."""
        return SamplingMetadata.from_requests(states, self.vocab_size, self.device, self.statics)

    def __call__(
        self,
        states: list[CachedRequestState],
        logits: torch.Tensor,
        greedy_ids: torch.Tensor | None,
        with_grammar: bool,
    ) -> SamplerOutput:
        """The tokens of `states`' rows (`logits` [rows, vocab]; `greedy_ids`: a full
        decode graph's argmax of them, or None), on every rank of the group: rank 0's.
        Only rank 0 returns logprobs."""
        if self.tp_group.rank == 0:
            out = self._sample(states, logits, greedy_ids, with_grammar)
        else:
            out = SamplerOutput([], None)
        if self.tp_group.world_size > 1:
            # Rank 0's tokens are every rank's: each feeds them to its next step.
            out = out._replace(sampled_token_ids=self._broadcast(out, len(states)))
        return out

    def _sample(
        self,
        states: list[CachedRequestState],
        logits: torch.Tensor,
        greedy_ids: torch.Tensor | None,
        with_grammar: bool,
    ) -> SamplerOutput:
        if greedy_ids is not None and not with_grammar:
            # The batch's statics alone can say the argmax is the rule: no metadata built.
            if self.statics.get(states, self.vocab_size, self.device).plain_greedy:
                return SamplerOutput(greedy_ids.tolist(), None)
        meta = self.metadata(states)
        if with_grammar:
            # A mask makes is_fast_greedy False: the graph's argmax is not used.
            meta.structured_output_mask = self.structured_output.grammar_bitmask(
                [s.grammar for s in states]
            )
        if greedy_ids is not None and meta.is_fast_greedy:
            # The graph's argmax: the sampler's greedy rule (first maximum).
            return SamplerOutput(greedy_ids.tolist(), None)
        return self.sampler(logits, meta)

    def _broadcast(self, out: SamplerOutput, num_rows: int) -> list[int]:
        """Rank 0's sampled ids, on every rank."""
        if self.tp_group.rank == 0:
            ids = torch.tensor(out.sampled_token_ids, dtype=torch.int64, device=self.device)
        else:
            ids = torch.empty(num_rows, dtype=torch.int64, device=self.device)
        return self.tp_group.broadcast(ids, src=0).tolist()
