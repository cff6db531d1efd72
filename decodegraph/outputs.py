"""What the engine returns to users, in vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """The log probability of one token, its rank in the vocabulary (1 = most likely)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with `n > 1` has n of these)."""

    index: int
    text: str
    token_ids: list[int]
    # Sum of the sampled tokens' logprobs; None unless logprobs were requested.
    cumulative_logprob: float | None
    # One dict per token in `token_ids`: token id -> Logprob (top-k plus the sampled one).
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    # The stop string or stop token id that ended the sequence; None for EOS.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once the sequence has a finish reason."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings of a request, all from `time.monotonic()`."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after a step: its prompt and its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # With `prompt_logprobs`: None for the first prompt token, then per prompt token a
    # dict token id -> Logprob (the prompt token plus the top-k); else None.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, later: RequestOutput) -> None:
        """Fold `later`, the next DELTA output of the same request, into this one, so that
        one output carries both steps' deltas (text and tokens appended, the latest
        finish state kept)."""
        by_index = {c.index: c for c in self.outputs}
        for new in later.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                by_index[new.index] = new
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason = new.finish_reason
            old.stop_reason = new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.metrics = later.metrics
        self.num_cached_tokens = later.num_cached_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
