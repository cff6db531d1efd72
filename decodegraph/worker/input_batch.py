"""What one step feeds the model (`InputBatch`), and the runner's own state per request.

The runner never holds the engine's `Request` objects: it learns each request once from
the scheduler (`NewRequestData`) and keeps a `CachedRequestState`, which it advances
with the scheduler's per-step deltas and the tokens it samples itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from decodegraph.core.sched_output import NewRequestData
from decodegraph.forward_context import BatchDescriptor
from decodegraph.graphs.modes import RuntimeMode
from decodegraph.sampling_params import SamplingParams
from decodegraph.worker.input_buffers import InputBuffers


@dataclass(eq=False, slots=True)
class CachedRequestState:
    """One request as the runner knows it (vLLM's name)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    # Per-request RNG for `seed`; None uses torch's global generator.
    generator: torch.Generator | None
    # Its block table: the KV-cache blocks of its tokens, in order.
    block_ids: list[int]
    # Tokens in the KV cache before the step being prepared.
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt then outputs.
    all_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_new_request(cls, new: NewRequestData, device: torch.device) -> CachedRequestState:
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(new.sampling_params.seed)
        return cls(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            sampling_params=new.sampling_params,
            eos_token_id=new.eos_token_id,
            generator=generator,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            all_token_ids=list(new.prompt_token_ids),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass(slots=True)
class InputBatch:
    """One step's batch, host side. The model reads its tensors from the persistent
    buffers (`InputBuffers`), which the step wrote first; these are the host values
    that go with them, and what the graph runner dispatched it to."""

    # [num_reqs] the requests' ids, in batch order.
    req_ids: list[str]
    # Requests in the batch (padded rows excluded).
    num_reqs: int
    # Tokens the requests compute (padded rows excluded).
    num_tokens: int
    # Request rows the attention metadata spans: num_reqs, a uniform graph's size, or
    # every row (max_num_seqs) for a mixed full graph.
    num_reqs_after_padding: int
    # Token rows the model runs: the graph key's size, or num_tokens when eager.
    num_tokens_after_padding: int
    # The most tokens one request computes.
    max_query_len: int
    # The longest context in the batch, this step's tokens included.
    max_seq_len: int
    # Every request computes exactly one token.
    uniform_decode: bool
    # [num_reqs + 1] where each request's tokens start in the batch, then the total.
    query_start_loc_cpu: list[int]
    # [num_reqs] each request's context length after this step.
    seq_lens_cpu: list[int]
    # [num_sampling] batch rows whose request reaches its last token and samples.
    sample_rows: list[int]
    # What runs this batch and under which key (the dispatcher's answer).
    runtime_mode: RuntimeMode
    batch_descriptor: BatchDescriptor

    @classmethod
    def make_dummy(
        cls,
        num_reqs: int,
        num_tokens: int,
        uniform: bool,
        buffers: InputBuffers,
        runtime_mode: RuntimeMode = RuntimeMode.NONE,
    ) -> InputBatch:
        """A batch of `num_reqs` dummy requests of one token each at context length 1,
        run over `num_tokens` rows (the rest padding), written into `buffers`.

        Graph capture uses it (docs/design.md §9: capture with lengths of 1, workspaces
        sized for max_model_len); its K/V go to the reserved null block 0. With
        `num_reqs=0` (the profiling run) nothing is attended or written. A mixed
        (`uniform=False`) batch's metadata spans every request row, as a mixed full
        graph's does.
        """
        if uniform and num_reqs != num_tokens:
            raise ValueError(f"a uniform dummy batch has one token per request, not {num_tokens}")
        views = num_reqs if uniform else buffers.max_num_reqs
        b = buffers
        b.input_ids.np[:num_tokens] = 0
        b.positions.np[:num_tokens] = 0
        b.slot_mapping.np[:num_reqs] = 0
        b.slot_mapping.np[num_reqs:num_tokens] = -1
        b.seq_lens.np[:num_reqs] = 1
        b.seq_lens.np[num_reqs:views] = 0
        b.query_start_loc.np[: num_reqs + 1] = np.arange(num_reqs + 1)
        b.query_start_loc.np[num_reqs + 1 : views + 1] = num_reqs
        b.clear_block_rows(0, views)
        b.copy_to_device(num_tokens, views)
        b.num_reqs_np[0] = num_reqs
        key = BatchDescriptor(num_tokens, num_tokens if uniform else None, uniform)
        return cls(
            req_ids=[f"dummy-{i}" for i in range(num_reqs)],
            num_reqs=num_reqs,
            num_tokens=num_reqs,
            num_reqs_after_padding=views,
            num_tokens_after_padding=num_tokens,
            max_query_len=1 if num_reqs else 0,
            max_seq_len=1 if num_reqs else 0,
            uniform_decode=uniform,
            query_start_loc_cpu=list(range(num_reqs + 1)),
            seq_lens_cpu=[1] * num_reqs,
            sample_rows=list(range(num_reqs)),
            runtime_mode=runtime_mode,
            batch_descriptor=key,
        )
