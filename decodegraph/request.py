"""A request's state as the engine and the scheduler share it (vLLM's `v1/request.py`).

The model runner never sees these objects: it gets plain scheduler data
(`core/sched_output.py`) and keeps its own per-request state.

There is no decoding phase nor prefill phase: each request just has its tokens
(prompt, then outputs) and how many of them are computed (in the KV cache). A step
computes some of the rest; when a request's computed tokens reach its token count,
the step samples one more token for it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from decodegraph.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from decodegraph.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style `finish_reason` of a finished status."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False, slots=True)
class Request:
    """One sequence being generated (a parent with `n > 1` fans out into n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prefix-cache hits included).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache when first scheduled.
    num_cached_tokens: int = 0
    # Chained hashes of the request's full blocks (filled by the KV cache manager).
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Token that triggered a stop (a stop_token_id or EOS), or the stop string.
    stop_reason: int | str | None = None
    # Timing (time.monotonic()): first scheduled, first token, last token.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Nothing is shown before the end (output_kind FINAL_ONLY, as LLM.generate runs) and
    # no per-token work waits on each token (stop strings, logprobs): the scheduler then
    # emits one output, when the request finishes, with every token.
    final_output_only: bool = field(init=False, default=False)
    # Prompt logprobs need every prompt position computed, so a prefix-cache hit must
    # not skip any (vLLM's name); its blocks are still cached for others.
    skip_reading_prefix_cache: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        params = self.sampling_params
        self.final_output_only = (
            params.output_kind is RequestOutputKind.FINAL_ONLY
            and not params.stop
            and params.logprobs is None
            and params.prompt_logprobs is None
        )
        self.skip_reading_prefix_cache = params.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
