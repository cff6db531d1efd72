"""What crosses the scheduler's boundaries each step.

To the model runner: `SchedulerOutput`, plain data only (ids, token ids, block ids,
sampling parameters), never the engine's live `Request` objects, so that a runner can
sit in another process (one per tensor-parallel rank). The runner keeps its own state
per request: it learns a request once (`NewRequestData`), then gets per-step deltas
(`CachedRequestData`), and appends the tokens it samples itself.

Back from the runner: `ModelRunnerOutput`. To the engine: one `EngineCoreOutput` per
request that progressed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decodegraph.outputs import Logprob
    from decodegraph.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen before: everything it needs to run it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The model's EOS id (min_tokens masks it); None without one.
    eos_token_id: int | None
    # Per KV cache group, its whole block table after this step's allocation.
    block_ids: tuple[list[int], ...]
    # Tokens already in the KV cache (a prefix-cache hit), not to be computed again.
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """Deltas for requests the runner already holds (parallel lists), only for those
    that have one this step: new blocks, or a return from preemption. A request without
    one is unchanged but for what the runner does itself: it advances its computed
    tokens by the tokens it computed, and appends the tokens it sampled."""

    req_ids: list[str] = field(default_factory=list)
    # Back from preemption: its old blocks are gone and `new_block_ids` is the whole
    # table; its tokens (prompt and outputs) are the runner's own, as before.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Per KV cache group, blocks appended since the previous step (the whole table when
    # resumed). A sliding-window group's table also had blocks before the window freed
    # (null in the scheduler's table): the runner's copy keeps their old ids, which the
    # native and Triton kernels never read and the tensor-op fallback masks out.
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    # Tokens in the KV cache before this step (a resumed request's prefix-cache hit).
    num_computed_tokens: list[int] = field(default_factory=list)

    def append(
        self, req_id: str, resumed: bool, new_block_ids: tuple[list[int], ...], num_computed: int
    ) -> None:
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed)


@dataclass
class SchedulerOutput:
    """One step's batch: which requests run and how many tokens each computes.

    Request `i` of the batch computes its tokens `[c, c + num_scheduled_tokens[i])`,
    `c` being its computed tokens before the step, and samples iff that reaches its
    token count (prompt plus outputs so far).
    """

    # Batch order: running requests first (in running order), then newly scheduled ones.
    req_ids: list[str]
    # Tokens each request computes this step, parallel to req_ids.
    num_scheduled_tokens: list[int]
    # sum(num_scheduled_tokens).
    total_num_scheduled_tokens: int
    # Requests scheduled for the first time, in batch order.
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    # Deltas for requests the runner holds (running, or resumed from preemption), in
    # batch order.
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # Requests preempted (blocks freed, sent back to waiting) during this schedule() call.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests finished or aborted since the previous schedule() call: the runner
    # drops whatever it keeps for them.
    finished_req_ids: set[str] = field(default_factory=set)
    # Steps the runner runs for this batch (multi-step scheduling, only for a batch of
    # decoding requests): the first as above, each later one computing every request's
    # token sampled by the step before (`continuation()`).
    num_steps: int = 1

    @property
    def num_reqs(self) -> int:
        """Number of scheduled requests."""
        return len(self.req_ids)

    def continuation(self) -> SchedulerOutput:
        """A multi-step batch's later step: the same requests, one token each, and
        nothing new for the runner (their blocks came with the first step)."""
        return SchedulerOutput(self.req_ids, self.num_scheduled_tokens, self.num_reqs)


@dataclass
class ModelRunnerOutput:
    """What the model runner produced for one `SchedulerOutput`."""

    # Request ids, parallel to SchedulerOutput.req_ids.
    req_ids: list[str]
    # The sampled token per request; None where the request has not reached its last
    # token yet (a partial chunked prefill or a preempted request catching up).
    sampled_token_ids: list[int | None]
    # Per request: token id -> Logprob (top-k plus the sampled token), or None where
    # not requested or nothing was sampled; None for the whole batch if nobody asked.
    logprobs: list[dict[int, Logprob] | None] | None = None
    # Request id -> its whole prompt logprobs (None for the first token, then one dict
    # per prompt token), sent with the step that samples its first token.
    prompt_logprobs_dict: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)
    # A multi-step batch's later steps (SchedulerOutput.num_steps - 1 of them), in order:
    # their sampled tokens and logprobs, parallel to req_ids like this step's.
    later_steps: list[ModelRunnerOutput] = field(default_factory=list)
    # Set by the step after which graphs made in the background serve: the dynamic decode
    # graph's (fewest, most) rows, and decode sizes made on demand. The driver's
    # dispatcher plans them from the next step.
    dynamic_decode_rows: tuple[int, int] | None = None
    decode_sizes_made: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request, passed from the scheduler to the
    engine's output processor (detokenizer, stop strings, `RequestOutput`)."""

    request_id: str
    new_token_ids: list[int]
    # One dict per new token: token id -> Logprob (top-k plus the sampled token).
    new_logprobs: list[dict[int, Logprob]] | None = None
    # The request's prompt logprobs, with its first output only (when it asked).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when the scheduler finished the request (EOS, stop token, length, abort).
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The request's first scheduling time and prompt tokens found in the prefix cache
    # then; both are fixed from the first output on (they feed `RequestOutput`).
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    # When the request's first token was sampled (a `final_output_only` request's one
    # output arrives long after it).
    first_token_time: float | None = None
