"""The output processor's prompt logprobs: texts filled in context, sent once in DELTA
outputs, in every CUMULATIVE one, and kept from the first child of an n > 1 request."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from decodegraph.core.sched_output import EngineCoreOutput
from decodegraph.engine.output_processor import OutputProcessor
from decodegraph.outputs import Logprob
from decodegraph.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tokenizer(stories_dir: Path):
    return AutoTokenizer.from_pretrained(stories_dir)


def _prompt_logprobs(ids: list[int]) -> list[dict[int, Logprob] | None]:
    return [None] + [{t: Logprob(-0.5, 1), 2: Logprob(-3.0, 2)} for t in ids[1:]]


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_prompt_logprobs_texts_and_how_often_they_are_sent(
    tokenizer, kind: RequestOutputKind
) -> None:
    ids = tokenizer.encode(PROMPT)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(prompt_logprobs=1, output_kind=kind, max_tokens=2)
    processor.add_request("p", PROMPT, ids, params, ["p"], arrival_time=0.0)
    first = processor.process_outputs(
        [EngineCoreOutput("p", [300], prompt_logprobs=_prompt_logprobs(ids))]
    ).request_outputs[0]
    second = processor.process_outputs(
        [EngineCoreOutput("p", [301], finish_reason="length")]
    ).request_outputs[0]
    pl = first.prompt_logprobs
    assert pl[0] is None and len(pl) == len(ids)
    assert "".join(pl[p][ids[p]].decoded_token for p in range(1, len(ids))) == PROMPT
    assert pl[1][2].decoded_token == "</s>"  # a special alternative shows its string
    if kind is RequestOutputKind.DELTA:
        assert second.prompt_logprobs is None
    else:
        assert second.prompt_logprobs is pl


def test_n_children_keep_the_first_copy(tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_request("p", PROMPT, ids, params, ["0_p", "1_p"], arrival_time=0.0)
    a, b = _prompt_logprobs(ids), _prompt_logprobs(ids)
    processor.process_outputs([EngineCoreOutput("0_p", [300], prompt_logprobs=a)])
    outs = processor.process_outputs(
        [
            EngineCoreOutput("1_p", [301], prompt_logprobs=b, finish_reason="length"),
            EngineCoreOutput("0_p", [302], finish_reason="length"),
        ]
    ).request_outputs
    assert len(outs) == 1 and outs[0].prompt_logprobs is a
