"""The step sampler: a full decode graph's argmax is taken as it is only where one argmax
is the whole rule; every other request goes through the sampler."""

from __future__ import annotations

import pytest
import torch

from decodegraph.distributed.parallel_state import TPGroup
from decodegraph.sample.metadata import SamplingMetadata
from decodegraph.worker.step_sampler import StepSampler
from tests.utils.requests import make_request_state

VOCAB = 16


def _step(params: dict, steps: int = 2) -> list[list[int]]:
    """Sample `steps` steps for two requests of `params`, with logits whose argmax is
    token 3 and a graph argmax that says 7: 7s mean the graph's ids were taken."""
    sampler = StepSampler(VOCAB, torch.device("cpu"), TPGroup(0, 1))
    states = [make_request_state(str(i), **{"temperature": 0.0, **params}) for i in range(2)]
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 5.0
    graph_ids = torch.full((2,), 7, dtype=torch.int64)
    out = []
    for _ in range(steps):
        sampled = sampler(states, logits, graph_ids, with_grammar=False).sampled_token_ids
        for state, tok in zip(states, sampled, strict=True):
            state.append_output_token(tok)
        out.append(sampled)
    return out


def test_plain_greedy_takes_the_graph_argmax_every_step() -> None:
    assert _step({}) == [[7, 7], [7, 7]]


@pytest.mark.parametrize(
    "params",
    [
        {"logprobs": 1},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"logit_bias": {5: 1.0}},
        {"temperature": 0.8, "top_k": 1},
    ],
)
def test_what_edits_logits_or_wants_logprobs_goes_through_the_sampler(params: dict) -> None:
    assert _step(params) == [[3, 3], [3, 3]]


def test_min_tokens_masks_until_reached_then_the_argmax_is_the_rule_again() -> None:
    # min_tokens masks the stop token (3, the argmax) until two tokens are out: the
    # sampler picks the next best (9); then the graph's argmax (3) is taken again.
    sampler = StepSampler(VOCAB, torch.device("cpu"), TPGroup(0, 1))
    states = [make_request_state("a", temperature=0.0, min_tokens=2, stop_token_ids=[3])]
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 9] = 5.0, 4.0
    ids = []
    for _ in range(3):
        tok = sampler(states, logits, torch.tensor([3]), False).sampled_token_ids[0]
        states[0].append_output_token(tok)
        ids.append(tok)
    assert ids == [9, 9, 3]


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"logprobs": 0},
        {"frequency_penalty": 0.1},
        {"min_tokens": 1},
        {"logit_bias": {1: -1.0}},
        {"temperature": 0.5},
    ],
)
def test_plain_greedy_statics_imply_the_fast_greedy_metadata(params: dict) -> None:
    states = [make_request_state("a", **{"temperature": 0.0, **params})]
    md = SamplingMetadata.from_requests(states, VOCAB, "cpu")
    if md.statics.plain_greedy:
        assert md.is_fast_greedy
    assert md.statics.plain_greedy == (params == {})
