"""The model runner's own state per request, kept from the scheduler's plain data.

The runner never holds the engine's `Request` objects: it learns each request once
(`NewRequestData`), then applies the scheduler's per-step deltas (`CachedRequestData`)
and appends the tokens it samples itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from decodegraph.core.sched_output import NewRequestData, SchedulerOutput
from decodegraph.outputs import Logprob
from decodegraph.sampling_params import SamplingParams

if TYPE_CHECKING:
    from decodegraph.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class CachedRequestState:
    """One request as the runner knows it (vLLM's name)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    # Per-request RNG for `seed`; None uses torch's global generator.
    generator: torch.Generator | None
    # Per KV cache group, its block table: the blocks of its tokens, in order. (A
    # sliding-window group's entries before the window may name blocks the scheduler
    # freed: no attention reads them.)
    block_ids: tuple[list[int], ...]
    # Tokens in the KV cache: set from the scheduler's data when the request arrives or
    # resumes, advanced by the runner as each step computes (InputBatch.prepare).
    num_computed_tokens: int
    # Prompt then outputs (one list: a sampled token is one append).
    all_token_ids: list[int] = field(default_factory=list)
    # Structured outputs: the request's matcher, advanced with every sampled token.
    grammar: object | None = None
    # Prompt logprobs computed so far (entry j scores prompt token j + 1) while the
    # request wants them and has not sampled its first token; else None
    # (worker/prompt_logprobs.py).
    prompt_logprobs: list[dict[int, Logprob]] | None = None

    @classmethod
    def from_new_request(
        cls,
        new: NewRequestData,
        device: torch.device,
        structured_output: StructuredOutputManager | None = None,
    ) -> CachedRequestState:
        grammar = None
        spec = new.sampling_params.structured_outputs
        if spec is not None and structured_output is not None:
            grammar = structured_output.new_grammar(spec)
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
            block_ids=tuple(list(ids) for ids in new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            all_token_ids=list(new.prompt_token_ids),
            grammar=grammar,
            prompt_logprobs=[] if new.sampling_params.prompt_logprobs is not None else None,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far (a copy)."""
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept_token(token_id):
            # The mask allows only what the grammar accepts, bar a stop token taken again
            # after the grammar ended (ignore_eos).
            logger.debug("request %s: token %d is outside its grammar", self.req_id, token_id)


class RequestStates:
    """Request id -> `CachedRequestState`, updated once per step."""

    def __init__(
        self, device: torch.device, structured_output: StructuredOutputManager | None = None
    ) -> None:
        self.device = device
        self.structured_output = structured_output
        self.states: dict[str, CachedRequestState] = {}
        # States with a grammar: while none is, a step builds no bitmask at all.
        self.num_with_grammar = 0
        # Requests still collecting prompt logprobs (most steps have none, and skip them).
        self.collecting_prompt_logprobs: set[str] = set()

    def __len__(self) -> int:
        return len(self.states)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.states

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self.states[req_id]

    def update(self, so: SchedulerOutput) -> list[CachedRequestState]:
        """Apply one step's scheduler data; returns the batch's states in batch order. A
        request resumed after preemption gets new block lists (so the input buffers
        rewrite its block-table row: `BlockTable.write_row`)."""
        states = self.states
        cached = so.scheduled_cached_reqs
        if not (so.finished_req_ids or so.scheduled_new_reqs or cached.req_ids):
            return [states[req_id] for req_id in so.req_ids]  # most decode steps
        for req_id in so.finished_req_ids:
            gone = states.pop(req_id, None)
            if gone is not None and gone.grammar is not None:
                self.num_with_grammar -= 1
            self.collecting_prompt_logprobs.discard(req_id)
        for new in so.scheduled_new_reqs:
            state = states[new.req_id] = CachedRequestState.from_new_request(
                new, self.device, self.structured_output
            )
            if state.grammar is not None:
                self.num_with_grammar += 1
            if state.prompt_logprobs is not None:
                self.collecting_prompt_logprobs.add(new.req_id)
        for req_id, resumed, new_block_ids, num_computed in zip(
            cached.req_ids,
            cached.resumed_from_preemption,
            cached.new_block_ids,
            cached.num_computed_tokens,
            strict=True,
        ):
            state = states[req_id]
            if resumed:
                state.block_ids = tuple(list(ids) for ids in new_block_ids)
                state.num_computed_tokens = num_computed
            else:
                for table, ids in zip(state.block_ids, new_block_ids, strict=True):
                    table.extend(ids)
        return [states[req_id] for req_id in so.req_ids]
