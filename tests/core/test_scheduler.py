"""Scheduler: continuous batching, budgets, chunked prefill, preemption, stops, no leaks.

Steps are driven by `KVModel`, a deterministic stand-in for the model runner: it writes
each computed token into a simulated paged KV cache through the step's block tables and
samples a token that is a function of the context read back through those tables. So a
wrong block table, a bad prefix-cache hit or a lost token after preemption changes the
output, and tests compare outputs against runs without that feature.
"""

from __future__ import annotations

import dataclasses

import pytest

from decodegraph.config import CacheConfig, SchedulerConfig
from decodegraph.core.kv_cache_spec import KVCacheGroupSpec, full_attention_groups
from decodegraph.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from decodegraph.core.scheduler import Scheduler
from decodegraph.outputs import Logprob
from decodegraph.request import Request, RequestStatus
from decodegraph.sampling_params import RequestOutputKind, SamplingParams
from tests.utils.requests import make_request

BLOCK_SIZE = 4


class KVModel:
    """Test driver: a fake model over simulated paged KV caches (token ids as K/V), one
    per KV cache group.

    Like the real model runner it sees only the scheduler's plain data: it keeps its own
    state per request (tokens, a block table per group) from `NewRequestData`, the
    per-step deltas and the tokens it samples, so a wrong delta changes the output too.
    A token is a function of the context read back through every group's table: all of
    it through a full-attention group, the last W positions through a sliding-window
    group (whose blocks before the window it never reads: the scheduler freed them)."""

    def __init__(
        self,
        num_blocks: int | list[int],
        block_size: int = BLOCK_SIZE,
        groups: list[KVCacheGroupSpec] | None = None,
    ) -> None:
        self.block_size = block_size
        self.groups = groups or full_attention_groups(block_size, 1)
        sizes = num_blocks if isinstance(num_blocks, list) else [num_blocks] * len(self.groups)
        self.kv: list[list[list[int | None]]] = [
            [[None] * block_size for _ in range(n)] for n in sizes
        ]
        # req id -> [tokens, block table per group, computed tokens]
        self.states: dict[str, list] = {}

    def _update(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states
            tokens = list(new.prompt_token_ids)
            tables = [list(ids) for ids in new.block_ids]
            self.states[new.req_id] = [tokens, tables, new.num_computed_tokens]
        cached = so.scheduled_cached_reqs
        for req_id, resumed, blocks, computed in zip(
            cached.req_ids,
            cached.resumed_from_preemption,
            cached.new_block_ids,
            cached.num_computed_tokens,
            strict=True,
        ):
            state = self.states[req_id]
            if resumed:
                state[1] = [list(ids) for ids in blocks]
                state[2] = computed
            else:
                for table, ids in zip(state[1], blocks, strict=True):
                    table.extend(ids)

    def _window(self, group: KVCacheGroupSpec) -> int | None:
        return getattr(group.spec, "sliding_window", None)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One batch, as the runner runs it: its step, then a multi-step batch's later
        steps (`SchedulerOutput.continuation`)."""
        out = self._execute_step(so)
        later = so.continuation()
        out.later_steps = [self._execute_step(later) for _ in range(so.num_steps - 1)]
        return out

    def _execute_step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens)
        self._update(so)
        sampled: list[int | None] = []
        for req_id, n in zip(so.req_ids, so.num_scheduled_tokens, strict=True):
            tokens, tables, computed = self.states[req_id]
            start, end = computed, computed + n
            assert 0 < n and end <= len(tokens)
            seen = []
            for group, table, kv in zip(self.groups, tables, self.kv, strict=True):
                window = self._window(group)
                first = max(0, start - window + 1) if window else 0  # the first query's
                assert len(table) * bs >= end and 0 not in table[first // bs :]
                for pos in range(start, end):
                    kv[table[pos // bs]][pos % bs] = tokens[pos]
                lo = max(0, end - window) if window else 0
                seen.append([kv[table[p // bs]][p % bs] for p in range(lo, end)])
            self.states[req_id][2] = end  # what it computed, as the runner counts
            if end < len(tokens):
                sampled.append(None)
                continue
            assert all(None not in context for context in seen)
            token = sum((sum(c) * 31 + len(c)) * (7 * g + 1) for g, c in enumerate(seen))
            token = token % 500 + 10
            tokens.append(token)
            sampled.append(token)
        return ModelRunnerOutput(list(so.req_ids), sampled)


def ids(*requests: Request) -> list[str]:
    return [r.request_id for r in requests]


def make_scheduler(
    num_blocks: int = 64,
    max_model_len: int = 128,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int | None = None,
    chunked: bool = True,
    prefix_caching: bool = True,
    num_scheduler_steps: int = 1,
) -> tuple[Scheduler, KVModel]:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked, num_scheduler_steps),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        max_model_len=max_model_len,
        num_blocks=num_blocks,
    )
    return sched, KVModel(num_blocks)


def step(sched: Scheduler, model: KVModel) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = sched.schedule()
    return so, sched.update_from_output(so, model.execute(so))


def run_to_completion(sched: Scheduler, model: KVModel, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        step(sched, model)
    raise AssertionError("requests did not finish")


def assert_all_blocks_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    for m in kv.managers:  # every KV cache group
        assert m.pool.num_free_blocks == m.pool.num_blocks - 1 and not m.req_to_blocks
    assert sched.kv_cache_usage == 0.0


def reference_outputs(prompts: dict[str, list[int]], **params) -> dict[str, list[int]]:
    """Outputs with a roomy cache, no chunking pressure and no prefix caching."""
    sched, model = make_scheduler(num_blocks=256, prefix_caching=False)
    reqs = [make_request(rid, p, **params) for rid, p in prompts.items()]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, model)
    return {r.request_id: r.output_token_ids for r in reqs}


PROMPTS = {f"r{i}": [(7 * i + j) % 50 + 1 for j in range(5 + 3 * i)] for i in range(4)}


def test_schedule_does_not_advance_computed_tokens_update_does() -> None:
    sched, model = make_scheduler()
    req = make_request("a", [1, 2, 3, 4, 5])
    sched.add_request(req)
    so = sched.schedule()
    assert so.num_scheduled_tokens == [5] and req.num_computed_tokens == 0
    assert req.status == RequestStatus.RUNNING and req.first_scheduled_time is not None
    outs = sched.update_from_output(so, model.execute(so))
    assert req.num_computed_tokens == 5 and req.num_output_tokens == 1
    assert [(o.request_id, len(o.new_token_ids), o.finish_reason) for o in outs] == [("a", 1, None)]


def test_continuous_batching_admits_new_requests_while_others_decode() -> None:
    sched, model = make_scheduler()
    a = make_request("a", PROMPTS["r1"])
    sched.add_request(a)
    step(sched, model)
    step(sched, model)
    b = make_request("b", PROMPTS["r2"])
    sched.add_request(b)
    so, outs = step(sched, model)
    # Running first (a decodes one token), then the new one with its whole prompt.
    assert so.req_ids == ids(a, b)
    assert so.num_scheduled_tokens == [1, b.num_prompt_tokens]
    assert {o.request_id for o in outs} == {"a", "b"}
    run_to_completion(sched, model)
    ref = reference_outputs({"a": PROMPTS["r1"], "b": PROMPTS["r2"]})
    assert a.output_token_ids == ref["a"] and b.output_token_ids == ref["b"]


def test_token_budget_is_respected_and_splits_the_last_admitted_prompt() -> None:
    sched, model = make_scheduler(max_num_batched_tokens=10)
    reqs = [make_request(str(i), [i + 1] * 6) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    so, _ = step(sched, model)
    assert so.req_ids == ids(*reqs[:2]) and so.num_scheduled_tokens == [6, 4]
    assert so.total_num_scheduled_tokens == 10
    so, _ = step(sched, model)
    # r0 decodes, r1 finishes its prompt, r2 gets what is left of the budget.
    assert so.num_scheduled_tokens == [1, 2, 6] and so.req_ids == ids(*reqs)
    run_to_completion(sched, model)
    assert all(r.num_output_tokens == 8 for r in reqs)


def test_max_num_seqs_caps_running_requests() -> None:
    sched, model = make_scheduler(max_num_seqs=2)
    reqs = [make_request(str(i), [i + 1] * 3, max_tokens=3) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    so, _ = step(sched, model)
    assert so.req_ids == ids(*reqs[:2]) and sched.num_waiting == 1
    step(sched, model)
    so, _ = step(sched, model)  # r0 and r1 finish here
    assert sched.num_running == 0
    so, _ = step(sched, model)
    assert so.req_ids == ids(reqs[2])
    assert so.finished_req_ids == {"0", "1"}


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_on_the_last_chunk() -> None:
    sched, model = make_scheduler(max_num_batched_tokens=8)
    prompt = [(3 * j) % 40 + 1 for j in range(25)]
    req = make_request("long", prompt, max_tokens=3)
    sched.add_request(req)
    chunks = []
    for _ in range(4):
        so, outs = step(sched, model)
        chunks.append(so.num_scheduled_tokens[0])
        assert (outs != []) == (req.num_computed_tokens == 25)
    assert chunks == [8, 8, 8, 1] and req.num_output_tokens == 1
    run_to_completion(sched, model)
    assert req.output_token_ids == reference_outputs({"long": prompt}, max_tokens=3)["long"]


def test_without_chunked_prefill_waiting_requests_are_admitted_whole_and_fcfs() -> None:
    sched, model = make_scheduler(max_num_batched_tokens=128, chunked=False)
    big = make_request("big", [1] * 100)
    small = make_request("small", [2] * 30)
    tiny = make_request("tiny", [3] * 2)
    for r in (big, small, tiny):
        sched.add_request(r)
    so, _ = step(sched, model)
    # small does not fit the 28 tokens left; tiny would, but it must not jump the queue.
    assert so.req_ids == ids(big) and so.num_scheduled_tokens == [100]
    so, _ = step(sched, model)
    assert so.req_ids == ids(big, small, tiny)
    assert so.num_scheduled_tokens == [1, 30, 2]


def test_chunking_disabled_needs_a_budget_of_max_model_len() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=64, max_model_len=128, chunked=False)


def test_preemption_under_a_tiny_block_budget_recomputes_the_latest_arrival() -> None:
    # 8 usable blocks of 4 tokens; each request needs up to (6 + 10) / 4 = 4 blocks
    # but holds fewer while it runs, so three of them start and then collide.
    sched, model = make_scheduler(num_blocks=9)
    prompts = {rid: [k + 1] * 6 for k, rid in enumerate("abc")}
    reqs = [make_request(rid, p, max_tokens=10) for rid, p in prompts.items()]
    for r in reqs:
        sched.add_request(r)
    victims: list[str] = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so, _ = step(sched, model)
        for rid in so.preempted_req_ids:
            victim = next(r for r in reqs if r.request_id == rid)
            assert victim.status == RequestStatus.PREEMPTED
            assert victim.num_computed_tokens == 0 and sched.waiting[0] is victim
            assert rid not in set(so.req_ids)
            victims.append(rid)
    assert victims and victims[0] == "c"  # the last to arrive goes first
    assert sum(r.num_preemptions for r in reqs) == len(victims)
    ref = reference_outputs(prompts, max_tokens=10)
    for r in reqs:
        assert r.output_token_ids == ref[r.request_id]
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_blocks_free(sched)


def test_preempted_request_goes_to_the_front_of_waiting_before_new_ones() -> None:
    # 4 usable blocks, two running requests of 4 prompt tokens, a third one queued by
    # max_num_seqs. At 9 tokens each needs its third block: a preempts b.
    sched, model = make_scheduler(num_blocks=5, max_num_seqs=2)
    a, b, c = (make_request(rid, [k + 1] * 4, max_tokens=8) for k, rid in enumerate("abc"))
    for r in (a, b, c):
        sched.add_request(r)
    preempted: set[str] = set()
    while not preempted:
        so, _ = step(sched, model)
        preempted = so.preempted_req_ids
    assert preempted == {"b"} and list(sched.waiting) == [b, c]
    assert so.req_ids == ids(a) and b.num_preemptions == 1
    run_to_completion(sched, model)
    assert [r.num_output_tokens for r in (a, b, c)] == [8, 8, 8]
    assert_all_blocks_free(sched)


def _plain(value: object) -> bool:
    """Whether a SchedulerOutput field holds plain data only (no live engine objects)."""
    if isinstance(value, (str, int, bool, type(None), SamplingParams)):
        return True
    if isinstance(value, (list, tuple, set)):
        return all(_plain(v) for v in value)
    if dataclasses.is_dataclass(value):
        return all(_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def test_the_runner_gets_plain_data_new_requests_once_then_deltas() -> None:
    # Blocks of 4 tokens; a 4-token prompt fills its first block, so its first decode
    # step allocates a second one, and later steps allocate nothing until token 9.
    sched, model = make_scheduler(num_blocks=5, max_num_seqs=2)
    a, b, c = (make_request(rid, [k + 1] * 4, max_tokens=8) for k, rid in enumerate("abc"))
    for r in (a, b, c):
        sched.add_request(r)
    so, _ = step(sched, model)
    assert _plain(so)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a", "b"]
    assert so.scheduled_new_reqs[0].prompt_token_ids == [1, 1, 1, 1]
    (table_a,) = so.scheduled_new_reqs[0].block_ids  # one KV cache group
    assert len(table_a) == 1 and so.scheduled_cached_reqs.req_ids == []
    so, _ = step(sched, model)
    cached = so.scheduled_cached_reqs
    assert so.scheduled_new_reqs == [] and cached.req_ids == ["a", "b"] == so.req_ids
    assert cached.num_computed_tokens == [4, 4] and cached.resumed_from_preemption == [False] * 2
    assert all(len(blocks) == 1 and len(blocks[0]) == 1 for blocks in cached.new_block_ids)
    so, _ = step(sched, model)
    assert so.req_ids == ["a", "b"]
    assert so.scheduled_cached_reqs.req_ids == []  # room left in their blocks: no deltas
    while not so.preempted_req_ids:
        so, _ = step(sched, model)
    assert so.preempted_req_ids == {"b"}
    while "b" not in so.req_ids:
        so, _ = step(sched, model)
    cached = so.scheduled_cached_reqs
    i = cached.req_ids.index("b")
    # Recomputed from its prefix-cache hit (whole blocks), not from where it was.
    resumed_at = b.num_computed_tokens - so.num_scheduled_tokens[so.req_ids.index("b")]
    assert cached.resumed_from_preemption[i] and cached.num_computed_tokens[i] == resumed_at
    assert resumed_at % BLOCK_SIZE == 0
    assert cached.new_block_ids[i] == (sched.kv_cache_manager.get_block_ids("b"),)
    assert "b" not in [n.req_id for n in so.scheduled_new_reqs]
    run_to_completion(sched, model)
    assert [r.num_output_tokens for r in (a, b, c)] == [8, 8, 8]


def test_request_that_outgrows_the_cache_is_length_capped_instead_of_livelocking() -> None:
    sched, model = make_scheduler(num_blocks=3, max_model_len=128)  # 8 token slots
    req = make_request("a", [1, 2, 3], max_tokens=100)
    sched.add_request(req)
    run_to_completion(sched, model)
    assert req.num_tokens == 8 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    with pytest.raises(ValueError, match="exceed"):
        sched.add_request(make_request("b", [1] * 9))


def test_prefix_cache_hit_skips_computed_blocks_and_keeps_output() -> None:
    sched, model = make_scheduler()
    shared = [(5 * j) % 30 + 1 for j in range(12)]
    a = make_request("a", shared + [40, 41])
    sched.add_request(a)
    run_to_completion(sched, model)
    b = make_request("b", shared + [42])
    sched.add_request(b)
    so, _ = step(sched, model)
    assert b.num_cached_tokens == 12 and so.num_scheduled_tokens == [1]
    assert sched.kv_cache_manager.prefix_cache_hits == 12
    run_to_completion(sched, model)
    assert b.output_token_ids == reference_outputs({"b": shared + [42]})["b"]
    assert_all_blocks_free(sched)


def test_abort_of_waiting_and_running_requests_frees_their_blocks() -> None:
    sched, model = make_scheduler(max_num_seqs=1)
    running = make_request("run", [1] * 9)
    waiting = make_request("wait", [2] * 3)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched, model)
    assert sched.num_running == 1 and sched.num_waiting == 1 and sched.kv_cache_usage > 0
    sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("run", RequestStatus.FINISHED_STOPPED)  # already finished: ignored
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    assert_all_blocks_free(sched)
    so = sched.schedule()
    assert so.req_ids == [] and so.finished_req_ids == {"run", "wait"}


def test_request_aborted_between_schedule_and_update_is_skipped() -> None:
    sched, model = make_scheduler()
    a, b = make_request("a", [1, 2]), make_request("b", [3, 4])
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    mo = model.execute(so)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(so, mo)
    assert [o.request_id for o in outs] == ["b"] and a.num_output_tokens == 0
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert_all_blocks_free(sched)


def _stop_run(
    prompt: list[int], eos: int | None = None, num_scheduler_steps: int = 1, **params
) -> Request:
    sched, model = make_scheduler(num_scheduler_steps=num_scheduler_steps)
    req = make_request("s", prompt, eos=eos, **params)
    sched.add_request(req)
    run_to_completion(sched, model)
    assert_all_blocks_free(sched)
    return req


STOP_PROMPT = [3, 1, 4, 1, 5]
REF = reference_outputs({"s": STOP_PROMPT}, max_tokens=12)["s"]
# An output token that first appears at index 3 (so it cannot stop the run earlier).
STOP_AT = next(i for i in range(3, 12) if REF[i] not in REF[:i])


def test_eos_stops_with_finish_reason_stop_and_no_stop_reason() -> None:
    req = _stop_run(STOP_PROMPT, eos=REF[STOP_AT], max_tokens=12)
    assert req.output_token_ids == REF[: STOP_AT + 1]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = _stop_run(STOP_PROMPT, eos=REF[STOP_AT], max_tokens=12, ignore_eos=True)
    assert req.output_token_ids == REF and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_id_stops_and_is_the_stop_reason() -> None:
    req = _stop_run(STOP_PROMPT, max_tokens=12, stop_token_ids=[REF[STOP_AT]])
    assert req.output_token_ids == REF[: STOP_AT + 1]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == REF[STOP_AT]


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached() -> None:
    req = _stop_run(
        STOP_PROMPT,
        eos=REF[STOP_AT],
        max_tokens=12,
        min_tokens=STOP_AT + 2,
        stop_token_ids=[REF[STOP_AT]],
    )
    assert req.num_output_tokens > STOP_AT + 1
    assert req.output_token_ids == REF[: req.num_output_tokens]


def test_max_tokens_caps_with_finish_reason_length() -> None:
    sched, model = make_scheduler()
    req = make_request("s", STOP_PROMPT, max_tokens=4)
    sched.add_request(req)
    finish = []
    while sched.has_unfinished_requests():
        finish += [o.finish_reason for o in step(sched, model)[1]]
    assert finish == [None, None, None, "length"] and req.output_token_ids == REF[:4]


def test_max_model_len_caps_prompt_plus_output() -> None:
    sched, model = make_scheduler(max_model_len=8)
    req = make_request("s", STOP_PROMPT, max_tokens=None)
    sched.add_request(req)
    run_to_completion(sched, model)
    assert req.num_tokens == 8 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_logprobs_are_passed_through_per_request() -> None:
    sched, model = make_scheduler()
    sched.add_request(make_request("a", [1, 2]))
    sched.add_request(make_request("b", [3, 4]))
    so = sched.schedule()
    mo = model.execute(so)
    lp = {mo.sampled_token_ids[0]: Logprob(-0.5, rank=1)}
    mo.logprobs = [lp, None]
    outs = sched.update_from_output(so, mo)
    assert outs[0].new_logprobs == [lp] and outs[1].new_logprobs is None


def test_every_block_is_free_after_a_mixed_workload() -> None:
    sched, model = make_scheduler(num_blocks=12, max_num_batched_tokens=16)
    reqs = [make_request(rid, p, max_tokens=6 + i) for i, (rid, p) in enumerate(PROMPTS.items())]
    reqs.append(make_request("dup", PROMPTS["r3"], max_tokens=5))
    for r in reqs:
        sched.add_request(r)
    for _ in range(3):
        step(sched, model)
    sched.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    run_to_completion(sched, model)
    assert all(r.is_finished for r in reqs)
    assert_all_blocks_free(sched)


def _outputs_per_step(**params) -> tuple[Request, list[list[EngineCoreOutput]], list[int]]:
    """Run one request to the end: its outputs per step and the generated-token count
    after each step."""
    sched, model = make_scheduler()
    req = make_request("a", [1, 2, 3], eos=None, **params)
    sched.add_request(req)
    outputs, counts = [], []
    while sched.has_unfinished_requests():
        outputs.append(step(sched, model)[1])
        counts.append(sched.num_generated_tokens)
    return req, outputs, counts


def test_a_final_output_only_request_gets_one_output_with_every_token() -> None:
    """FINAL_ONLY without stop strings or logprobs (LLM.generate's requests): nothing
    per step, then one output with all tokens, the finish reason and the first token's
    time; the generated-token count still advances every step."""
    final_only = RequestOutputKind.FINAL_ONLY
    req, outputs, counts = _outputs_per_step(max_tokens=5, output_kind=final_only)
    assert req.final_output_only
    assert [len(o) for o in outputs] == [0, 0, 0, 0, 1]
    (out,) = outputs[-1]
    assert out.new_token_ids == req.output_token_ids and len(out.new_token_ids) == 5
    assert out.finish_reason == "length" and out.first_token_time == req.first_token_time
    assert out.first_token_time is not None and out.first_token_time < req.last_token_time
    assert counts == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "params",
    [
        {},  # CUMULATIVE, the default
        {"output_kind": RequestOutputKind.DELTA},
        {"output_kind": RequestOutputKind.FINAL_ONLY, "stop": ["x"]},  # checked per token
        {"output_kind": RequestOutputKind.FINAL_ONLY, "logprobs": 1},
    ],
    ids=["cumulative", "delta", "final-with-stop", "final-with-logprobs"],
)
def test_other_requests_get_an_output_per_token(params: dict) -> None:
    req, outputs, counts = _outputs_per_step(max_tokens=5, **params)
    assert not req.final_output_only
    assert [[o.new_token_ids for o in step_outs] for step_outs in outputs] == [
        [[t]] for t in req.output_token_ids
    ]
    assert counts == [1, 2, 3, 4, 5]


# -- multi-step scheduling (num_scheduler_steps) ----------------------------------------


def _run_multi_step(
    prompts: dict[str, list[int]], num_steps: int, num_blocks: int = 64, **params
) -> tuple[dict[str, list[int]], list[int], dict[str, list[int]], int]:
    """Outputs of a multi-step run, each batch's step count, the tokens of each
    request's outputs joined (what the engine's output processor receives), and the
    preemptions."""
    sched, model = make_scheduler(num_blocks=num_blocks, num_scheduler_steps=num_steps)
    reqs = [make_request(rid, p, **params) for rid, p in prompts.items()]
    for r in reqs:
        sched.add_request(r)
    steps: list[int] = []
    streamed: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        so, outs = step(sched, model)
        steps.append(so.num_steps)
        for o in outs:
            streamed[o.request_id] += o.new_token_ids
    assert_all_blocks_free(sched)
    outputs = {r.request_id: r.output_token_ids for r in reqs}
    return outputs, steps, streamed, sched.num_preemptions


@pytest.mark.parametrize("num_steps", [2, 4, 7])
def test_multi_step_batches_give_the_outputs_of_single_steps(num_steps: int) -> None:
    ref = reference_outputs(PROMPTS, max_tokens=19)
    out, steps, streamed, _ = _run_multi_step(PROMPTS, num_steps, max_tokens=19)
    assert out == ref and streamed == ref
    assert max(steps) == num_steps  # it did run multi-step batches
    # Fewer scheduler steps than tokens: the point of it.
    assert len(steps) < 19 + 1


def test_multi_step_runs_only_while_every_request_decodes_and_none_can_be_admitted() -> None:
    sched, model = make_scheduler(num_scheduler_steps=4)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=30))
    assert step(sched, model)[0].num_steps == 1  # the prompt
    assert step(sched, model)[0].num_steps == 4  # decoding alone
    sched.add_request(make_request("b", [4, 5, 6, 7, 8, 9], max_tokens=30))
    so, _ = step(sched, model)
    assert so.num_steps == 1 and so.num_scheduled_tokens == [1, 6]  # b's prompt: one step
    assert step(sched, model)[0].num_steps == 4  # both decode now


def test_a_full_batch_runs_multi_step_beside_a_queue_and_admits_it_when_a_slot_frees() -> None:
    """max_num_seqs 2, three requests: the third waits for a slot in any case, so the
    two decode in batches of steps; once one finishes, the third's prompt runs."""
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9]}
    ref = reference_outputs(prompts, max_tokens=9)
    sched, model = make_scheduler(max_num_seqs=2, num_scheduler_steps=4)
    reqs = [make_request(rid, p, max_tokens=9) for rid, p in prompts.items()]
    for r in reqs:
        sched.add_request(r)
    plan = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, model)
        plan.append((so.req_ids, so.num_steps))
    assert plan[:4] == [(["a", "b"], 1), (["a", "b"], 4), (["a", "b"], 4)] + [(["c"], 1)]
    assert {r.request_id: r.output_token_ids for r in reqs} == ref
    assert_all_blocks_free(sched)


def test_multi_step_never_plans_past_max_tokens_or_the_model_length() -> None:
    _, steps, _, _ = _run_multi_step({"a": [1, 2, 3]}, 8, max_tokens=6)
    assert steps == [1, 5]  # the prompt's token, then the 5 left
    sched, model = make_scheduler(max_model_len=10, num_scheduler_steps=8)
    req = make_request("a", [1, 2, 3], max_tokens=None)
    sched.add_request(req)
    counts = [step(sched, model)[0].num_steps for _ in range(2)]
    assert counts == [1, 6] and req.num_tokens == 10
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_stop_token_inside_a_multi_step_batch_drops_the_tokens_after_it() -> None:
    req = _stop_run(STOP_PROMPT, eos=REF[STOP_AT], num_scheduler_steps=8, max_tokens=12)
    assert req.output_token_ids == REF[: STOP_AT + 1]
    assert req.status == RequestStatus.FINISHED_STOPPED
    req = _stop_run(STOP_PROMPT, stop_token_ids=[REF[STOP_AT]], num_scheduler_steps=8)
    assert req.output_token_ids == REF[: STOP_AT + 1] and req.stop_reason == REF[STOP_AT]


def test_multi_step_under_a_tiny_kv_cache_falls_back_without_changing_outputs() -> None:
    """Too few blocks for every step's slots: the batch runs one step, so taking slots
    ahead preempts no more than single steps do; the outputs stay a roomy cache's."""
    ref = reference_outputs(PROMPTS, max_tokens=19)
    out, steps, streamed, preempted = _run_multi_step(PROMPTS, 6, num_blocks=14, max_tokens=19)
    assert out == ref and streamed == ref
    assert 1 in steps[3:] and 6 in steps
    *_, single_preempted = _run_multi_step(PROMPTS, 1, num_blocks=14, max_tokens=19)
    assert 0 < single_preempted and preempted <= single_preempted


def test_slots_taken_ahead_never_preempt_a_request_of_the_same_step() -> None:
    """Two requests each about to start a new block, two blocks free: one step each
    fits, eight steps each do not. Taking the first request's slots ahead would leave
    none for the second, which a single step gives room: the batch runs one step."""
    sched, model = make_scheduler(num_blocks=5, num_scheduler_steps=8)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, [1, 2, 3, 4], max_tokens=30))
    step(sched, model)  # both prompts: a block each, two of the four usable left
    so, _ = step(sched, model)
    assert so.num_steps == 1 and not so.preempted_req_ids
    assert so.num_scheduled_tokens == [1, 1]


def test_multi_step_logprobs_arrive_one_per_token() -> None:
    sched, model = make_scheduler(num_scheduler_steps=3)
    sched.add_request(make_request("a", [1, 2], max_tokens=4, logprobs=0))
    step(sched, model)  # the prompt
    so = sched.schedule()
    assert so.num_steps == 3
    mo = model.execute(so)
    for k, out in enumerate([mo, *mo.later_steps]):
        out.logprobs = [{out.sampled_token_ids[0]: Logprob(-float(k), rank=1)}]
    (eco,) = sched.update_from_output(so, mo)
    assert len(eco.new_token_ids) == 3 and eco.finish_reason == "length"
    pairs = zip(eco.new_logprobs, eco.new_token_ids, strict=True)
    assert [lp[t].logprob for lp, t in pairs] == [0, -1, -2]


def test_num_scheduler_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=0)
