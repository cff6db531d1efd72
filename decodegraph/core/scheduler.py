"""Continuous batching: which requests run in a step and how many tokens each computes.

There is no prefill phase nor decode phase here. Each request has its tokens (prompt,
then outputs) and how many of them are computed; a step gives each scheduled request
some of the rest, within a token budget (`max_num_batched_tokens`) and a request
budget (`max_num_seqs`). A decoding request needs one token, a new one its whole
prompt (or a chunk of it with chunked prefill), a preempted one everything it had
(prompt and outputs so far, recomputed; it samples again only once it has caught up,
so its output does not change).

Order: running requests first, in arrival order, then waiting ones first come, first
served. When a running request needs a block and none is free, the running request
that arrived last is preempted (its blocks are freed and it goes to the front of the
waiting queue) until the allocation fits.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from decodegraph.config import CacheConfig, SchedulerConfig
from decodegraph.core.kv_cache_manager import GroupBlocks, KVCacheManager
from decodegraph.core.kv_cache_spec import KVCacheGroupSpec
from decodegraph.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from decodegraph.request import Request, RequestStatus

if TYPE_CHECKING:
    from decodegraph.outputs import Logprob

logger = logging.getLogger(__name__)


class Scheduler:
    """vLLM v1-style scheduler over a paged KV cache with prefix caching.

    One step is `schedule()`, the model runner, then `update_from_output()`; a second
    `schedule()` before the update is not supported.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int | Sequence[int],
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens or max(
            2048, max_model_len
        )
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.num_scheduler_steps = scheduler_config.num_scheduler_steps
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        if not self.enable_chunked_prefill and self.max_num_scheduled_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_scheduled_tokens}) is smaller than "
                f"max_model_len ({max_model_len}): without chunked prefill a long prompt "
                "could never be scheduled; raise it or enable chunked prefill"
            )
        kv = self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, cache_config.enable_prefix_caching, kv_cache_groups
        )
        # A request that outgrew the whole cache would preempt itself forever, so cap
        # the length at what the cache holds when that is below max_model_len. A sliding
        # window group holds a request's window, whatever its length.
        capacity = kv.max_request_tokens or max_model_len
        if capacity < max_model_len:
            logger.warning(
                "KV cache holds %d tokens, less than max_model_len %d: requests are "
                "length-capped at %d tokens",
                capacity,
                max_model_len,
                capacity,
            )
        self.max_request_len = min(max_model_len, capacity)
        for m, n in zip(kv.managers, kv.num_blocks, strict=True):
            if m.window is not None and n < m.window.window_blocks + 2:
                raise ValueError(
                    "num_gpu_blocks_override: a sliding-window KV cache group needs at least "
                    f"{m.window.window_blocks + 2} blocks (its window's, the one being "
                    f"written and one more), got {n}"
                )
        # The most tokens one step computes for one request (what a sliding-window group
        # can hold at once: KVCacheManager.max_chunk_tokens).
        self.max_chunk_tokens = kv.max_chunk_tokens or self.max_num_scheduled_tokens
        if not self.enable_chunked_prefill and self.max_chunk_tokens < self.max_request_len:
            # Without chunks a prompt, or a preempted request's recompute, runs in one step.
            logger.warning(
                "a sliding-window KV cache group holds %d tokens of one step: without "
                "chunked prefill requests are length-capped at %d tokens",
                self.max_chunk_tokens,
                self.max_chunk_tokens,
            )
            self.max_request_len = self.max_chunk_tokens

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(); handed to the runner then.
        self.finished_req_ids: set[str] = set()
        # The last schedule()'s requests, in batch order (update_from_output's).
        self._scheduled: list[Request] = []
        # Tokens sampled and appended so far (counted per step, whenever they are shown).
        self.num_generated_tokens = 0
        self.num_preemptions = 0  # over the engine's life (vLLM's num_preemptions)

    # -- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING) behind the ones already waiting."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        if request.num_tokens == 0:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        if request.num_tokens > self.max_request_len:
            raise ValueError(
                f"request {request.request_id!r}: {request.num_tokens} prompt tokens exceed "
                f"the maximum length {self.max_request_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish waiting or running requests from outside (abort, stop string).

        Frees their blocks. Unknown or already finished ids are ignored.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests: {status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.running or self.waiting)

    def get_num_unfinished_requests(self) -> int:
        """Number of waiting plus running requests."""
        return len(self.running) + len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks (scheduled in the last step or about to be)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued, new or preempted."""
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of usable KV blocks in use, in [0, 1]."""
        return self.kv_cache_manager.usage

    # -- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts and allocate their blocks."""
        kv = self.kv_cache_manager
        token_budget = self.max_num_scheduled_tokens
        scheduled: list[Request] = []
        req_ids: list[str] = []
        num_scheduled: list[int] = []
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData([], [], [], [])
        preempted: set[str] = set()

        # Running requests, highest priority (earliest arrival) first.
        running = self.running
        # Steps after the first that this batch runs (multi-step: 0 unless it may).
        lookahead = self._multi_step_lookahead() if self.num_scheduler_steps > 1 else 0
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_new = min(
                request.num_tokens - request.num_computed_tokens,
                token_budget,
                self.max_chunk_tokens,
            )
            # A multi-step batch takes every step's slots now (_multi_step_lookahead saw
            # them all free, so none preempts).
            new_blocks = self._allocate_or_preempt(request, num_new + lookahead, preempted)
            if new_blocks is None:
                break  # the request preempted itself: it was the tail, nothing is left
            scheduled.append(request)
            req_ids.append(request.request_id)
            num_scheduled.append(num_new)
            if new_blocks is not kv.nothing_new and any(new_blocks):
                cached.append(
                    request.request_id,
                    False,
                    tuple([b.block_id for b in blocks] for blocks in new_blocks),
                    request.num_computed_tokens,
                )
            token_budget -= num_new
            req_index += 1

        # Waiting requests, first come first served; none in a step that had to preempt
        # (the cache is full, and a preempted request would be readmitted at once).
        waiting = self.waiting
        while waiting and token_budget > 0 and not preempted and len(running) < self.max_num_seqs:
            request = waiting[0]
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if num_new > min(token_budget, self.max_chunk_tokens):
                if not self.enable_chunked_prefill:
                    break
                num_new = min(token_budget, self.max_chunk_tokens)
            if kv.allocate_slots(request, num_new, computed_blocks) is None:
                break
            waiting.popleft()
            resumed = request.status == RequestStatus.PREEMPTED
            request.num_computed_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            running.append(request)
            scheduled.append(request)
            req_ids.append(request.request_id)
            num_scheduled.append(num_new)
            block_ids = tuple(list(ids) for ids in kv.get_group_block_ids(request.request_id))
            if resumed:
                cached.append(request.request_id, True, block_ids, num_computed)
            else:
                new_reqs.append(
                    NewRequestData(
                        req_id=request.request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        sampling_params=request.sampling_params,
                        eos_token_id=request.eos_token_id,
                        block_ids=block_ids,
                        num_computed_tokens=num_computed,
                    )
                )
            token_budget -= num_new

        finished = self.finished_req_ids
        self.finished_req_ids = set()
        self._scheduled = scheduled
        return SchedulerOutput(
            req_ids=req_ids,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - token_budget,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            preempted_req_ids=preempted,
            finished_req_ids=finished,
            num_steps=lookahead + 1,
        )

    def _multi_step_lookahead(self) -> int:
        """How many steps after the first this schedule() may plan (multi-step
        scheduling). Only while every running request decodes one token and no waiting
        request could be admitted (with max_num_seqs running, it waits for one to finish
        either way); up to num_scheduler_steps in all, never past a request's max_tokens
        or length (no step computes a token nobody may keep, barring a stop token or
        string), and none unless every step's slots are free now."""
        if not self.running or (self.waiting and len(self.running) < self.max_num_seqs):
            return 0  # a waiting request this step could admit is not held back
        steps = min(self.num_scheduler_steps, self.max_chunk_tokens)
        max_len = self.max_request_len
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens != 1:
                return 0
            steps = min(steps, max_len - request.num_tokens)
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                steps = min(steps, max_tokens - request.num_output_tokens)
        if steps < 2 or len(self.running) > self.max_num_scheduled_tokens:
            return 0
        # Every step's slots must fit in the free blocks as they are: taken ahead, they
        # must never push a later request of this step into preemption.
        for m in self.kv_cache_manager.managers:
            need = sum(
                m.num_blocks_to_allocate(r.request_id, r.num_computed_tokens + steps, ())
                for r in self.running
            )
            if need > m.pool.num_free_blocks:
                return 0
        return steps - 1

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted: set[str]
    ) -> GroupBlocks | None:
        """Allocate for a running request, preempting from the tail of `running` until
        it fits; returns the new blocks. Victims come after `request` (the tail is
        scheduled last), so nothing already scheduled this step is lost. None if
        `request` itself was preempted."""
        while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None
        return new_blocks

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop its K/V; it restarts from token 0 later."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, apply stop rules.

        `scheduler_output` must be the last `schedule()`'s (its requests are looked up
        in the order it scheduled them). Returns one `EngineCoreOutput` per request
        that got a token or finished, except
        that a request with `final_output_only` gets one only when it finishes, carrying
        all its tokens. Requests finished from outside since `schedule()` are skipped.
        """
        kv = self.kv_cache_manager
        block_size = kv.block_size
        cache_full_blocks, check_stop = kv.cache_full_blocks, self._check_stop
        running = RequestStatus.RUNNING
        sampled_token_ids = model_output.sampled_token_ids
        logprobs = model_output.logprobs
        prompt_logprobs = model_output.prompt_logprobs_dict
        later_steps = model_output.later_steps
        num_scheduled = scheduler_output.num_scheduled_tokens
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        num_generated = 0
        now = time.monotonic()
        for i, request in enumerate(self._scheduled):
            if request.status != running:
                continue  # aborted (or stop string) after schedule(): already freed
            n = num_scheduled[i]
            request.num_computed_tokens += n
            token_id = sampled_token_ids[i]
            if token_id is None:
                cache_full_blocks(request)
                continue
            request.append_output_token(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            # One new token fills a block only when it lands on the block's last slot.
            if n > 1 or request.num_computed_tokens % block_size == 0:
                cache_full_blocks(request)
            num_generated += 1
            finished = check_stop(request, token_id)
            later_ids = later_logprobs = None
            if later_steps and not finished:
                finished, later_ids, later_logprobs = self._append_later_steps(
                    request, i, later_steps
                )
                num_generated += len(later_ids)
            if finished:
                stopped.append(request)
            if request.final_output_only:
                if not finished:
                    continue
                new_token_ids = list(request.output_token_ids)  # its one output: every token
                new_logprobs = None
            else:
                new_token_ids = [token_id]
                req_logprobs = logprobs[i] if logprobs is not None else None
                new_logprobs = [req_logprobs] if req_logprobs is not None else None
                if later_ids:
                    new_token_ids += later_ids
                    if new_logprobs is not None:
                        new_logprobs += later_logprobs
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    finish_reason=request.status.finish_reason if finished else None,
                    stop_reason=request.stop_reason,
                    first_scheduled_time=request.first_scheduled_time,
                    num_cached_tokens=request.num_cached_tokens,
                    first_token_time=request.first_token_time,
                    prompt_logprobs=(
                        prompt_logprobs.get(request.request_id) if prompt_logprobs else None
                    ),
                )
            )
        self.num_generated_tokens += num_generated
        if stopped:
            stopped_set = set(stopped)
            self.running = [r for r in self.running if r not in stopped_set]
            for request in stopped:
                self._free_request(request)
        return outputs

    def _append_later_steps(
        self, request: Request, i: int, later_steps: list[ModelRunnerOutput]
    ) -> tuple[bool, list[int], list[dict[int, Logprob] | None]]:
        """A multi-step batch's later tokens of batch row `i`, appended to the request
        until one stops it (the runner's tokens after that are dropped): whether it
        finished, and the tokens appended with their logprobs (None where not asked)."""
        block_size = self.block_size
        ids: list[int] = []
        lps: list[dict[int, Logprob] | None] = []
        for out in later_steps:
            token_id = out.sampled_token_ids[i]
            request.num_computed_tokens += 1
            request.append_output_token(token_id)
            if request.num_computed_tokens % block_size == 0:
                self.kv_cache_manager.cache_full_blocks(request)
            ids.append(token_id)
            lps.append(out.logprobs[i] if out.logprobs is not None else None)
            if self._check_stop(request, token_id):
                return True, ids, lps
        return False, ids, lps

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Apply the stop rules for a just-appended token; sets status and stop_reason."""
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            stop_token_ids = params.stop_token_ids
            if stop_token_ids and token_id in stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        max_tokens = params.max_tokens
        if (max_tokens is not None and num_output >= max_tokens) or (
            request.num_tokens >= self.max_request_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
