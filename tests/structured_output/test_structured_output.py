"""Offline structured outputs: StructuredOutputsParams' checks, the grammar cache, a bad
spec's ValueError, and a grammar's end stopping the request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decodegraph import LLM, SamplingParams
from decodegraph.sampling_params import StructuredOutputsParams

# The offline engine of these tests (the multi-step one adds num_scheduler_steps).
ENGINE_KWARGS = {
    "enforce_eager": True,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "structured_outputs_config": {"disable_any_whitespace": True},
}


@pytest.fixture(scope="module")
def llm(stories_dir: Path) -> LLM:
    return LLM(str(stories_dir), **ENGINE_KWARGS)


def seeded_regex_params(regex: str, count: int, max_tokens: int) -> list[SamplingParams]:
    """`count` sampled (temperature 1) requests of `regex`, seeded 0 to count - 1."""
    return [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=max_tokens,
            structured_outputs=StructuredOutputsParams(regex=regex),
        )
        for i in range(count)
    ]


def test_params_need_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="^structured_outputs: exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="^structured_outputs: exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="^structured_outputs.choice:"):
        StructuredOutputsParams(choice=[""])
    with pytest.raises(ValueError, match="^structured_outputs.json: not valid JSON"):
        StructuredOutputsParams(json="{")
    with pytest.raises(ValueError, match="^structured_outputs: must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_a_schema_as_dict_or_text_shares_one_cache_entry() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_text = json.dumps(schema, indent=2)
    assert StructuredOutputsParams(json=schema).key() == StructuredOutputsParams(json=as_text).key()


def test_a_grammar_compiles_once_per_spec(llm: LLM) -> None:
    manager = llm.llm_engine.structured_output
    spec = StructuredOutputsParams(regex="[a-c]{2}")
    before = manager.num_compiled
    params = SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=spec)
    outs = llm.generate(["Once"] * 3, [params] * 3, use_tqdm=False)
    llm.generate("Twice", SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False)
    assert manager.num_compiled == before + 1
    assert all(len(o.outputs[0].text) == 2 for o in outs)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"json": {"type": "foo"}}, "structured_outputs.json"),
        ({"regex": "(ab"}, "structured_outputs.regex"),
        ({"grammar": 'root ::= "a" | '}, "structured_outputs.grammar"),
    ],
)
def test_an_invalid_spec_is_a_value_error_naming_it_and_queues_nothing(
    llm: LLM, spec: dict, field: str
) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=f"^{field.replace('.', '[.]')}: "):
        llm.generate("Once", params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_the_grammars_end_stops_the_request_with_eos(llm: LLM) -> None:
    spec = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.generate(
        "Once", SamplingParams(max_tokens=20, structured_outputs=spec), use_tqdm=False
    )[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert out.token_ids[-1] == llm.llm_engine.eos_token_id


def test_a_grammar_that_allows_nothing_is_refused(llm: LLM) -> None:
    spec = StructuredOutputsParams(grammar="root ::= root")
    with pytest.raises(ValueError, match="^structured_outputs[.]grammar: .*allows no output"):
        llm.llm_engine.structured_output.compile(spec)


def test_a_dead_end_inside_a_grammar_ends_the_request(llm: LLM) -> None:
    """After "a" no token can follow (x only derives itself): the row allows EOS."""
    spec = StructuredOutputsParams(grammar='root ::= "a" x\nx ::= x')
    out = llm.generate(
        "Once", SamplingParams(max_tokens=10, structured_outputs=spec), use_tqdm=False
    )[0].outputs[0]
    assert out.text == "a" and out.finish_reason == "stop"


def test_preempted_requests_keep_their_grammar_position(stories_dir: Path) -> None:
    """Under a KV cache of a little over one sequence, requests are preempted and
    recomputed; their matchers (the runner's, kept across preemption) stay in step with
    their tokens, so every output still matches and equals its unpreempted self."""
    import re

    regex = r"[a-z]{4}( [a-z]{2,6}){12}\."
    kwargs = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 6, "seed": 0}
    params = seeded_regex_params(regex, 6, 100)
    prompts = [{"prompt_token_ids": [1, 30 + 9 * i] + [40] * (10 + 3 * i)} for i in range(6)]
    tiny = LLM(str(stories_dir), num_gpu_blocks_override=10, **kwargs)
    scheduler = tiny.llm_engine.scheduler
    preempted = []
    preempt = scheduler._preempt
    scheduler._preempt = lambda request: (preempted.append(request.request_id), preempt(request))
    outs = tiny.generate(prompts, params, use_tqdm=False)
    roomy = LLM(str(stories_dir), **kwargs)
    alone = roomy.generate(prompts, params, use_tqdm=False)
    for out, ref in zip(outs, alone, strict=True):
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert preempted


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_greedy_masks_hold_in_the_other_graph_modes(stories_dir: Path, mode: str) -> None:
    """FULL graphs compute a fused argmax for uniform decode batches too; PIECEWISE
    replays pieces. A greedy constrained request beside a free one answers its choice,
    the free one its own text, as in FULL_DECODE_ONLY and NONE (the server tests)."""
    llm = LLM(
        str(stories_dir),
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        # Inductor off: the traced graphs replay as they are, and capture is quick.
        compilation_config={
            "cudagraph_mode": mode,
            "cudagraph_capture_sizes": [2],
            "use_inductor": False,
        },
    )
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    masked = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]{6}")
    )
    alone = llm.generate("Once upon a time", free, use_tqdm=False)[0].outputs[0].text
    both = llm.generate(["Once upon a time"] * 2, [masked, free], use_tqdm=False)
    assert len(both[0].outputs[0].text) == 6 and both[0].outputs[0].text.isalpha()
    assert both[1].outputs[0].text == alone
    runs = llm.llm_engine.get_stats().graph_runs
    assert sum(n for m, n in runs.items() if m != "NONE") > 0, runs


def test_grammars_hold_across_multi_step_batches(stories_dir: Path, llm: LLM) -> None:
    """num_scheduler_steps=4: each later step's mask comes from the matcher the step
    before advanced, so seeded regex outputs equal single steps'; a choice's end inside a
    batch of steps stops the request at its EOS, the steps after it dropped."""
    import re

    multi = LLM(str(stories_dir), num_scheduler_steps=4, **ENGINE_KWARGS)
    regex = r"[a-z]{3}( [a-z]{2,5}){5}\."
    params = seeded_regex_params(regex, 3, 60)
    prompts = [f"Once upon a time {i}" for i in range(3)]
    got = multi.generate(prompts, params, use_tqdm=False)
    want = llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert re.fullmatch(regex, g.outputs[0].text), g.outputs[0].text
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    choice = SamplingParams(
        max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    out = multi.generate("Once", choice, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert out.token_ids[-1] == multi.llm_engine.eos_token_id
    assert out.token_ids == llm.generate("Once", choice, use_tqdm=False)[0].outputs[0].token_ids
