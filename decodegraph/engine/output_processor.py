"""Turns what the scheduler produced each step into `RequestOutput`s.

It owns everything about a request that only matters to the user: its text (incremental
detokenization), stop strings, logprob texts, the per-`output_kind` shape of each output,
and the fan-in of a parent request's `n` children into one `RequestOutput`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from decodegraph.core.sched_output import EngineCoreOutput
from decodegraph.engine.detokenizer import IncrementalDetokenizer
from decodegraph.engine.logprob_text import TokenTexts
from decodegraph.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from decodegraph.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ProcessedOutputs:
    """One step's results for the user, and what the scheduler must now finish."""

    request_outputs: list[RequestOutput]
    # Child request ids that hit a stop string: finish them as FINISHED_STOPPED.
    reqs_to_abort: list[str]


@dataclass(eq=False, slots=True)
class _ChildState:
    """One of a parent's n sequences."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # Decodes logprob tokens after the sequence so far (None without a tokenizer).
    token_texts: TokenTexts | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # How much of token_ids / logprobs earlier DELTA outputs already carried.
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0


@dataclass(eq=False, slots=True)
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_ChildState]
    child_ids: list[str]
    metrics: RequestMetrics
    num_unfinished: int
    # Prompt tokens served from the prefix cache (the first sequence's, as scheduled).
    num_cached_tokens: int | None = None
    # With params.prompt_logprobs, once the first sequence computed them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Whether a DELTA output already carried them.
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    """Keeps per-request output state and builds the user-facing outputs of each step.

    With `tokenizer=None` (skip_tokenizer_init) text stays "" and only token ids flow.
    """

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        # Child request id -> (parent, child).
        self._children: dict[str, tuple[_ParentState, _ChildState]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_request_ids: list[str],
        arrival_time: float,
    ) -> None:
        """Track a parent request whose sequences run as `child_request_ids` (child i is
        `CompletionOutput.index` i; for n=1 the one child may share the parent's id)."""
        if request_id in self._parents:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if not child_request_ids:
            raise ValueError("child_request_ids: at least one child is required")
        children = []
        # Text (the output's and each logprob's) only where there is a tokenizer and the
        # request wants it.
        tokenizer = self.tokenizer if params.detokenize else None
        for index in range(len(child_request_ids)):
            detok = None
            if tokenizer is not None:
                detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
            logprobs: list[dict[int, Logprob]] | None = None
            cumulative: float | None = None
            texts = None
            if params.logprobs is not None:
                logprobs, cumulative = [], 0.0
                if tokenizer is not None:
                    texts = TokenTexts(tokenizer, prompt_token_ids[-8:], params.skip_special_tokens)
            children.append(
                _ChildState(
                    index,
                    detok,
                    logprobs=logprobs,
                    cumulative_logprob=cumulative,
                    token_texts=texts,
                )
            )
        parent = _ParentState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            children=children,
            child_ids=list(child_request_ids),
            metrics=RequestMetrics(arrival_time=arrival_time),
            num_unfinished=len(children),
        )
        self._parents[request_id] = parent
        for child_id, child in zip(child_request_ids, children, strict=True):
            self._children[child_id] = (parent, child)

    def abort_request(self, request_id: str) -> None:
        """Forget a parent request and its children (no further outputs)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        for child_id in parent.child_ids:
            self._children.pop(child_id, None)

    def child_ids(self, request_id: str) -> list[str]:
        """The child request ids of a running parent ([] when unknown or finished)."""
        parent = self._parents.get(request_id)
        return list(parent.child_ids) if parent is not None else []

    def has_unfinished_requests(self) -> bool:
        """True while any tracked request still has an unfinished sequence."""
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Fold one step's outputs into request state; return what users should see."""
        now = time.monotonic()
        reqs_to_abort: list[str] = []
        # Parents touched this step, in first-seen order, with the children touched.
        touched: dict[str, tuple[_ParentState, list[_ChildState]]] = {}
        find, process_one = self._children.get, self._process_one
        final_only = RequestOutputKind.FINAL_ONLY
        for out in outputs:
            entry = find(out.request_id)
            if entry is None:
                continue  # aborted, or finished by a stop string in an earlier step
            parent, child = entry
            if child.finish_reason is not None:
                continue
            if process_one(parent, child, out, now):
                reqs_to_abort.append(out.request_id)
            if parent.num_unfinished and parent.params.output_kind is final_only:
                continue  # nothing to show before the end (LLM.generate's case)
            touched.setdefault(parent.request_id, (parent, []))[1].append(child)

        request_outputs = []
        for parent, children in touched.values():
            request_output = self._make_request_output(parent, children, now)
            if request_output is not None:
                request_outputs.append(request_output)
            if parent.num_unfinished == 0:
                self.abort_request(parent.request_id)
        return ProcessedOutputs(request_outputs, reqs_to_abort)

    def _process_one(
        self, parent: _ParentState, child: _ChildState, out: EngineCoreOutput, now: float
    ) -> bool:
        """Update one child; True when a stop string finished it (the scheduler must be
        told to stop it)."""
        params, metrics = parent.params, parent.metrics
        new_ids = out.new_token_ids
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = out.first_scheduled_time
        if parent.num_cached_tokens is None and out.first_scheduled_time is not None:
            parent.num_cached_tokens = out.num_cached_tokens
        if new_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = out.first_token_time or now
            metrics.last_token_time = now
        if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = self._with_prompt_texts(
                parent.prompt_token_ids, out.prompt_logprobs, params
            )

        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        new_logprobs = out.new_logprobs
        stopped_by_string = False
        if child.detokenizer is not None:
            text_ids = new_ids
            # The EOS / stop token that ended the sequence is not part of its text.
            if (
                finish_reason == "stop"
                and not isinstance(stop_reason, str)
                and not params.include_stop_str_in_output
            ):
                text_ids = new_ids[:-1]
            stop_string = child.detokenizer.update(text_ids)
            if stop_string is not None:
                stopped_by_string = finish_reason is None
                finish_reason, stop_reason = "stop", stop_string
                # Of a multi-step batch's tokens, none after the stop string's last.
                kept = len(text_ids) - child.detokenizer.num_dropped
                if kept < len(new_ids):
                    new_ids = new_ids[:kept]
                    new_logprobs = new_logprobs[:kept] if new_logprobs else new_logprobs
        child.token_ids += new_ids
        if child.logprobs is not None and new_logprobs:
            for token_id, entry in zip(new_ids, new_logprobs, strict=True):
                if child.token_texts is not None:
                    _fill_decoded_tokens(child.token_texts, token_id, entry)
                child.logprobs.append(entry)
                assert child.cumulative_logprob is not None
                child.cumulative_logprob += entry[token_id].logprob
        if finish_reason is not None:
            child.finish_reason, child.stop_reason = finish_reason, stop_reason
            parent.num_unfinished -= 1
        return stopped_by_string

    def _with_prompt_texts(
        self,
        prompt_token_ids: list[int],
        prompt_logprobs: list[dict[int, Logprob] | None],
        params: SamplingParams,
    ) -> list[dict[int, Logprob] | None]:
        if self.tokenizer is None or not params.detokenize or len(prompt_token_ids) < 2:
            return prompt_logprobs
        texts = TokenTexts(self.tokenizer, prompt_token_ids[:1], params.skip_special_tokens)
        for token_id, entry in zip(prompt_token_ids[1:], prompt_logprobs[1:], strict=True):
            assert entry is not None
            _fill_decoded_tokens(texts, token_id, entry)
        return prompt_logprobs

    def _make_request_output(
        self, parent: _ParentState, touched: list[_ChildState], now: float
    ) -> RequestOutput | None:
        kind = parent.params.output_kind
        finished = parent.num_unfinished == 0
        if finished:
            parent.metrics.finished_time = now
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        # A DELTA output carries only the sequences that changed this step.
        children = sorted(touched, key=lambda c: c.index) if delta else parent.children
        prompt_logprobs = parent.prompt_logprobs
        if delta and prompt_logprobs is not None:
            # Sent once, with the first output that has them (as vLLM's DELTA outputs).
            if parent.prompt_logprobs_sent:
                prompt_logprobs = None
            parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[self._completion(child, delta) for child in children],
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens or 0,
            prompt_logprobs=prompt_logprobs,
        )

    def _completion(self, child: _ChildState, delta: bool) -> CompletionOutput:
        finished = child.finish_reason is not None
        text = ""
        if child.detokenizer is not None:
            text = child.detokenizer.get_next_output_text(finished, delta)
        token_ids = child.token_ids
        logprobs = child.logprobs
        if delta:
            token_ids = token_ids[child.num_sent_tokens :]
            child.num_sent_tokens = len(child.token_ids)
            if logprobs is not None:
                logprobs = logprobs[child.num_sent_logprobs :]
                child.num_sent_logprobs = len(child.logprobs or [])
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=child.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=child.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
        )


def _fill_decoded_tokens(texts: TokenTexts, token_id: int, entry: dict[int, Logprob]) -> None:
    """Set each Logprob's `decoded_token` to its piece in the sequence's context, then
    append `token_id` (the one the sequence took) to that context."""
    _, pieces = texts.add(token_id, entry)
    for t, logprob in entry.items():
        logprob.decoded_token = pieces[t]
