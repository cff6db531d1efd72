"""The output processor with real EngineCoreOutputs and the stories260K tokenizer:
output kinds, n > 1 fan-in, stop strings, logprobs, and state cleanup."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from decodegraph.core.sched_output import EngineCoreOutput
from decodegraph.engine.output_processor import OutputProcessor
from decodegraph.outputs import Logprob
from decodegraph.sampling_params import RequestOutputKind, SamplingParams

BOS, EOS = 1, 2
TEXT = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(scope="module")
def tokenizer(stories_dir: Path):
    return AutoTokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


def add(
    processor: OutputProcessor, rid: str = "p", children: list[str] | None = None, **params
) -> SamplingParams:
    sp = SamplingParams(**params)
    processor.add_request(rid, "", [BOS], sp, children or [rid], arrival_time=0.0)
    return sp


def step(processor: OutputProcessor, *outs: EngineCoreOutput):
    return processor.process_outputs(list(outs))


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds_shape_text_and_ids(tokenizer, text_ids, kind: RequestOutputKind) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, output_kind=kind)
    texts, ids, results = [], [], []
    for i, token_id in enumerate(text_ids):
        last = i == len(text_ids) - 1
        out = EngineCoreOutput("p", [token_id], finish_reason="length" if last else None)
        results += step(processor, out).request_outputs
    for r in results:
        assert r.request_id == "p" and len(r.outputs) == 1
        texts.append(r.outputs[0].text)
        ids.append(r.outputs[0].token_ids)
    final = results[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert [r.finished for r in results[:-1]] == [False] * (len(results) - 1)
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(results) == 1 and texts == [TEXT] and ids == [text_ids]
    elif kind is RequestOutputKind.CUMULATIVE:
        assert len(results) == len(text_ids)
        assert ids[3] == text_ids[:4] and texts[-1] == TEXT
        assert all(texts[k + 1].startswith(texts[k]) for k in range(len(texts) - 1))
    else:
        assert "".join(texts) == TEXT and sum(ids, []) == text_ids
        assert all(len(x) == 1 for x in ids)
    assert not processor.has_unfinished_requests()


def test_n_children_fan_in_to_one_output_with_indices(tokenizer, text_ids) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, "p", ["p-0", "p-1", "p-2"], n=3)
    r = step(
        processor,
        EngineCoreOutput("p-0", text_ids[:2]),
        EngineCoreOutput("p-2", text_ids[:1], finish_reason="length"),
    ).request_outputs
    assert len(r) == 1 and not r[0].finished
    assert [c.index for c in r[0].outputs] == [0, 1, 2]
    assert r[0].outputs[1].token_ids == [] and r[0].outputs[2].finished()
    r = step(
        processor,
        EngineCoreOutput("p-1", [EOS], finish_reason="stop"),
        EngineCoreOutput("p-0", text_ids[2:3], finish_reason="length"),
    ).request_outputs
    assert r[0].finished and [c.finish_reason for c in r[0].outputs] == ["length", "stop", "length"]
    assert r[0].outputs[0].text == tokenizer.decode(text_ids[:3])
    assert r[0].outputs[1].text == ""  # the EOS is not text
    assert not processor.has_unfinished_requests()


def test_delta_with_n_children_carries_only_the_changed_ones(tokenizer, text_ids) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, "p", ["a", "b"], n=2, output_kind=RequestOutputKind.DELTA)
    r = step(processor, EngineCoreOutput("b", text_ids[:1])).request_outputs
    assert [(c.index, c.token_ids) for c in r[0].outputs] == [(1, text_ids[:1])]


def test_stop_string_finishes_the_child_and_asks_to_abort_it(tokenizer, text_ids) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, "p", ["p-0", "p-1"], n=2, stop=["little"])
    result = None
    for token_id in text_ids:
        result = step(processor, EngineCoreOutput("p-0", [token_id]))
        if result.reqs_to_abort:
            break
    assert result is not None and result.reqs_to_abort == ["p-0"]
    completion = result.request_outputs[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "little"
    assert completion.text == "Once upon a time, there was a "
    # The scheduler's later report for the stopped child is ignored.
    assert (
        step(processor, EngineCoreOutput("p-0", [EOS], finish_reason="stop")).request_outputs == []
    )
    assert processor.has_unfinished_requests()  # p-1 still runs


def test_a_stop_string_inside_several_tokens_keeps_none_after_it(tokenizer, text_ids) -> None:
    """A multi-step batch's tokens arrive together: the output ends with the token that
    completed the stop string, as token by token; its logprobs and sum too."""
    single = OutputProcessor(tokenizer)
    add(single, stop=["little"])
    want = None
    for token_id in text_ids:
        want = step(single, EngineCoreOutput("p", [token_id])).request_outputs[0].outputs[0]
        if want.finished():
            break
    assert want is not None and want.stop_reason == "little"
    processor = OutputProcessor(tokenizer)
    add(processor, stop=["little"], logprobs=0)
    # The last output's tokens run past the stop string and end with the EOS.
    tokens = [*text_ids, EOS]
    lps = [{t: Logprob(-1.0, 1)} for t in tokens]
    result = step(
        processor,
        EngineCoreOutput("p", tokens[:3], new_logprobs=lps[:3]),
        EngineCoreOutput("p", tokens[3:], new_logprobs=lps[3:], finish_reason="stop"),
    )
    got = result.request_outputs[-1].outputs[0]
    assert result.reqs_to_abort == []  # the scheduler finished it already (EOS)
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    assert (got.finish_reason, got.stop_reason) == ("stop", "little")
    assert got.logprobs is not None and len(got.logprobs) == len(want.token_ids)
    assert got.cumulative_logprob == pytest.approx(-len(want.token_ids))


def test_stop_token_text_is_dropped_unless_included(tokenizer) -> None:
    period = tokenizer.encode("cat.", add_special_tokens=False)
    for include, expected in ((False, "cat"), (True, "cat.")):
        processor = OutputProcessor(tokenizer)
        add(processor, stop_token_ids=[period[-1]], include_stop_str_in_output=include)
        out = EngineCoreOutput("p", period, finish_reason="stop", stop_reason=period[-1])
        completion = step(processor, out).request_outputs[0].outputs[0]
        assert completion.text == expected and completion.token_ids == period
        assert completion.stop_reason == period[-1]


def test_logprobs_are_decoded_and_summed(tokenizer, text_ids) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, logprobs=1, output_kind=RequestOutputKind.DELTA)
    a, b = text_ids[0], text_ids[1]
    out = EngineCoreOutput(
        "p",
        [a, b],
        new_logprobs=[{a: Logprob(-0.5, 1), 7: Logprob(-1.0, 2)}, {b: Logprob(-0.25, 1)}],
    )
    completion = step(processor, out).request_outputs[0].outputs[0]
    assert completion.cumulative_logprob == pytest.approx(-0.75)
    assert completion.logprobs is not None and len(completion.logprobs) == 2
    assert completion.logprobs[0][a].decoded_token == tokenizer.decode([a])
    assert completion.logprobs[0][7].decoded_token == tokenizer.decode([7])
    nxt = step(processor, EngineCoreOutput("p", [a], new_logprobs=[{a: Logprob(-1.0, 1)}]))
    completion = nxt.request_outputs[0].outputs[0]
    assert len(completion.logprobs or []) == 1
    assert completion.cumulative_logprob == pytest.approx(-1.75)


def test_without_logprobs_cumulative_logprob_is_none(tokenizer, text_ids) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor)
    completion = step(processor, EngineCoreOutput("p", text_ids[:2])).request_outputs[0].outputs[0]
    assert completion.cumulative_logprob is None and completion.logprobs is None


def test_without_a_tokenizer_only_ids_flow(text_ids) -> None:
    processor = OutputProcessor(None)
    add(processor, stop=["little"], logprobs=0)
    out = EngineCoreOutput(
        "p",
        text_ids,
        new_logprobs=[{t: Logprob(-1.0, 1)} for t in text_ids],
        finish_reason="length",
    )
    result = step(processor, out)
    completion = result.request_outputs[0].outputs[0]
    assert completion.text == "" and completion.token_ids == text_ids
    assert result.reqs_to_abort == []
    assert (
        completion.logprobs is not None
        and completion.logprobs[0][text_ids[0]].decoded_token is None
    )


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_detokenize_false_gives_ids_and_no_text(tokenizer, text_ids, kind) -> None:
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(detokenize=False, logprobs=0, prompt_logprobs=0, output_kind=kind)
    prompt = [BOS, text_ids[0]]  # two tokens: the second's logprob would get a text
    processor.add_request("p", "", prompt, params, ["p"], arrival_time=0.0)
    prompt_lps: list = [None, {prompt[1]: Logprob(-1.0, 1)}]
    outs = []
    for i, t in enumerate(text_ids):
        last = i == len(text_ids) - 1
        out = EngineCoreOutput(
            "p",
            [t],
            new_logprobs=[{t: Logprob(-1.0, 1)}],
            finish_reason="length" if last else None,
            prompt_logprobs=prompt_lps if i == 0 else None,
        )
        outs += step(processor, out).request_outputs
    assert all(o.outputs[0].text == "" for o in outs)
    final = outs[-1]
    ids = (
        final.outputs[0].token_ids
        if kind is not RequestOutputKind.DELTA
        else [t for o in outs for t in o.outputs[0].token_ids]
    )
    assert ids == text_ids
    lps = [lp for o in outs for lp in (o.outputs[0].logprobs or [])]
    if kind is RequestOutputKind.CUMULATIVE:
        lps = final.outputs[0].logprobs or []
    assert len(lps) == len(text_ids)
    assert all(lp[t].decoded_token is None for lp, t in zip(lps, text_ids, strict=True))
    assert outs[0].prompt_logprobs is not None
    assert outs[0].prompt_logprobs[1][prompt[1]].decoded_token is None


def test_metrics_record_token_and_finish_times(tokenizer, text_ids) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor)
    first = step(processor, EngineCoreOutput("p", text_ids[:1])).request_outputs[0].metrics
    assert first is not None and first.first_token_time is not None
    assert first.finished_time is None
    last = step(processor, EngineCoreOutput("p", text_ids[1:2], finish_reason="length"))
    metrics = last.request_outputs[0].metrics
    assert metrics is not None and metrics.finished_time is not None
    assert metrics.arrival_time <= metrics.first_token_time <= metrics.last_token_time


def test_abort_drops_state_and_ignores_later_outputs(tokenizer, text_ids) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, "p", ["p-0", "p-1"], n=2)
    processor.abort_request("p")
    assert not processor.has_unfinished_requests()
    assert step(processor, EngineCoreOutput("p-0", text_ids[:1])).request_outputs == []
    add(processor, "p", ["p-0", "p-1"], n=2)  # the id can be reused afterwards
    with pytest.raises(ValueError, match="^request_id: "):
        add(processor, "p", ["p-0"])
