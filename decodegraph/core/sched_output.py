"""What crosses the boundary between the scheduler and the model runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decodegraph.engine.request import Request
    from decodegraph.outputs import Logprob


@dataclass
class SchedulerOutput:
    """One step's batch: which requests run and how many tokens each computes.

    `schedule()` does not advance `request.num_computed_tokens`: the runner computes
    tokens `all_token_ids[num_computed_tokens : num_computed_tokens + n]` of each
    request, and a request samples iff `num_computed_tokens + n == num_tokens`. (On
    admission `schedule()` does set it to the prefix-cache hit, or to 0 on preemption:
    those tokens are in the cache, or no longer are, before the step runs.)
    """

    # Batch order: running requests first (in running order), then newly scheduled ones.
    scheduled_requests: list[Request]
    # Tokens each scheduled request computes this step, parallel to scheduled_requests.
    num_scheduled_tokens: list[int]
    # sum(num_scheduled_tokens).
    total_num_scheduled_tokens: int
    # Each scheduled request's whole block table after this step's allocation
    # (a snapshot), parallel to scheduled_requests.
    block_ids: list[list[int]]
    # Requests preempted (blocks freed, sent back to waiting) during this schedule() call.
    preempted_request_ids: set[str] = field(default_factory=set)
    # Requests finished or aborted since the previous schedule() call: the runner
    # drops whatever per-request state it keeps for them.
    finished_request_ids: set[str] = field(default_factory=set)

    @property
    def num_reqs(self) -> int:
        """Number of scheduled requests."""
        return len(self.scheduled_requests)


@dataclass
class ModelRunnerOutput:
    """What the model runner produced for one `SchedulerOutput`."""

    # Request ids, parallel to SchedulerOutput.scheduled_requests.
    req_ids: list[str]
    # The sampled token per request; None where the request has not reached its last
    # token yet (a partial chunked prefill or a preempted request catching up).
    sampled_token_ids: list[int | None]
    # Per request: token id -> Logprob (top-k plus the sampled token), or None where
    # not requested or nothing was sampled; None for the whole batch if nobody asked.
    logprobs: list[dict[int, Logprob] | None] | None = None
