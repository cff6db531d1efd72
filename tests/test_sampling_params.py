"""SamplingParams: vLLM defaults, normalisation, validation messages, child copies."""

from __future__ import annotations

import pytest

from decodegraph.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM


def test_stop_strings_need_detokenize() -> None:
    # vLLM's rule: a stop string is found in the text, which detokenize=False never makes.
    with pytest.raises(ValueError, match="^stop: stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    assert SamplingParams(stop_token_ids=[3], detokenize=False).stop_token_ids == [3]


def test_stop_string_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("temperature", -1),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", 1.5),
        ("seed", "1"),
        ("stop", [""]),
        ("stop", [1]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 3),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -2),
        ("logprobs", 1.5),
        ("prompt_logprobs", -2),
        ("ignore_eos", "yes"),
        ("detokenize", 0),
        ("output_kind", "delta"),
    ],
)
def test_invalid_values_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(ValueError, match="^min_tokens: "):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=50).min_tokens == 50


def test_edge_values_are_accepted() -> None:
    p = SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, logprobs=20, presence_penalty=-2.0)
    assert not p.top_k_enabled
    assert SamplingParams(top_k=0, logprobs=0).logprobs == 0
    # -1 is the whole vocabulary; how many a request may ask for is the engine's
    # max_logprobs, checked when the request arrives.
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).prompt_logprobs == -1
    assert SamplingParams(logprobs=1000).logprobs == 1000


def test_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_children_get_n_1_and_offset_seeds_without_sharing_lists() -> None:
    parent = SamplingParams(n=3, seed=10, stop=["x"])
    children = [parent.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 for c in children)
    children[0].stop.append("y")
    assert parent.stop == ["x"]
    assert SamplingParams(n=2).for_child(1).seed is None
