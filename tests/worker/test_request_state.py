"""The runner's request states, rebuilt from the scheduler's plain data alone."""

from __future__ import annotations

import torch

from decodegraph.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from decodegraph.sampling_params import SamplingParams
from decodegraph.worker.request_state import RequestStates

CPU = torch.device("cpu")


def _new(req_id: str, prompt: list[int], blocks: list[int], **params: object) -> NewRequestData:
    return NewRequestData(req_id, prompt, SamplingParams(**params), 2, (blocks,), 0)  # type: ignore[arg-type]


def _step(req_ids: list[str], counts: list[int], **fields: object) -> SchedulerOutput:
    return SchedulerOutput(req_ids, counts, sum(counts), **fields)  # type: ignore[arg-type]


def test_a_new_request_is_learned_once_then_updated_by_deltas() -> None:
    states = RequestStates(CPU)
    batch = states.update(_step(["a"], [3], scheduled_new_reqs=[_new("a", [1, 5, 6], [7])]))
    (a,) = batch
    assert (a.req_id, a.all_token_ids, a.block_ids, a.num_computed_tokens) == (
        "a",
        [1, 5, 6],
        ([7],),
        0,
    )
    assert a.eos_token_id == 2
    a.append_output_token(9)  # what the runner samples, it appends itself
    a.num_computed_tokens = 3  # what the runner's step computed (InputBatch.prepare)
    batch = states.update(_step(["a"], [1]))  # no delta: nothing changes
    assert batch == [a] and a.num_computed_tokens == 3 and a.block_ids == ([7],)
    cached = CachedRequestData()
    cached.append("a", False, ([8],), 4)
    states.update(_step(["a"], [1], scheduled_cached_reqs=cached))
    assert a.block_ids == ([7, 8],) and a.all_token_ids == [1, 5, 6, 9]


def test_a_resumed_request_gets_its_whole_new_table_and_keeps_its_tokens() -> None:
    states = RequestStates(CPU)
    states.update(_step(["a"], [2], scheduled_new_reqs=[_new("a", [1, 5], [3, 4])]))
    states["a"].append_output_token(11)
    cached = CachedRequestData()
    cached.append("a", True, ([9, 10],), 0)
    old_table = states["a"].block_ids[0]
    batch = states.update(_step(["a"], [3], scheduled_cached_reqs=cached, preempted_req_ids=set()))
    assert batch[0].block_ids == ([9, 10],) and batch[0].num_computed_tokens == 0
    assert batch[0].all_token_ids == [1, 5, 11]
    assert batch[0].block_ids[0] is not old_table  # a new list: its row is rewritten


def test_finished_requests_are_dropped_and_the_batch_keeps_scheduler_order() -> None:
    states = RequestStates(CPU)
    news = [_new(r, [1], [i + 1]) for i, r in enumerate("abc")]
    states.update(_step(["a", "b", "c"], [1, 1, 1], scheduled_new_reqs=news))
    batch = states.update(_step(["c", "a"], [1, 1], finished_req_ids={"b"}))
    assert [s.req_id for s in batch] == ["c", "a"] and "b" not in states and len(states) == 2


def test_a_seeded_request_gets_its_own_generator_from_its_seed() -> None:
    states = RequestStates(CPU)
    new = [_new("s", [1], [1], seed=7, temperature=1.0), _new("g", [1], [2])]
    states.update(_step(["s", "g"], [1, 1], scheduled_new_reqs=new))
    assert states["g"].generator is None
    expected = torch.rand(3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.rand(3, generator=states["s"].generator), expected)
