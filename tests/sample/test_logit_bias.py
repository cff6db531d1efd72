"""`SamplingParams.logit_bias`: added to a request's logits before sampling, per row, in
the sampler and through a real engine in eager and full-graph modes (the graph's fused
greedy pick must not bypass it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decodegraph.entrypoints.llm import LLM
from decodegraph.sample.metadata import SamplingMetadata
from decodegraph.sample.sampler import Sampler
from decodegraph.sampling_params import SamplingParams
from tests.utils.requests import make_request_state

VOCAB = 32


def test_logit_bias_moves_greedy_pick_of_its_row_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    reqs = [make_request_state(str(i), temperature=0.0) for i in range(3)]
    reqs[1].sampling_params = SamplingParams(temperature=0.0, logit_bias={7: 100.0})
    md = SamplingMetadata.from_requests(reqs, VOCAB, "cpu")
    assert not md.is_fast_greedy
    out = Sampler()(logits, md)
    want = logits.argmax(-1).tolist()
    assert out.sampled_token_ids == [want[0], 7, want[2]]


def test_logit_bias_bans_a_token_when_sampling() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 5.0
    req = make_request_state("0")
    req.sampling_params = SamplingParams(temperature=1.0, logit_bias={3: -100})
    md = SamplingMetadata.from_requests([req], VOCAB, "cpu")
    assert all(Sampler()(logits, md).sampled_token_ids[0] != 3 for _ in range(20))


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    logits = torch.randn(1, VOCAB)
    req = make_request_state("0")
    req.sampling_params = SamplingParams(temperature=0.0, logprobs=0, logit_bias={5: 100})
    out = Sampler()(logits, SamplingMetadata.from_requests([req], VOCAB, "cpu"))
    assert out.sampled_token_ids == [5]
    assert out.logprobs[0][5].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 5].item())


def test_logit_bias_keys_and_values_are_checked_and_clamped() -> None:
    assert SamplingParams(logit_bias={"12": 500}).logit_bias == {12: 100.0}
    with pytest.raises(ValueError, match="^logit_bias:"):
        SamplingParams(logit_bias={"x": 1})
    with pytest.raises(ValueError, match="^logit_bias:"):
        SamplingParams(logit_bias={1: "a"})


@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY"])
def test_engine_applies_logit_bias_in_graph_modes(stories_dir: Path, mode: str) -> None:
    llm = LLM(
        str(stories_dir),
        compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2]},
        max_model_len=64,
    )
    forced = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={300: 100})
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = llm.generate(["Once upon a time", "Once upon a time"], [forced, plain], use_tqdm=False)
    assert out[0].outputs[0].token_ids == [300] * 6
    assert out[1].outputs[0].token_ids != [300] * 6
    if mode != "NONE":
        assert llm.llm_engine.runner.graph_runner.mode_counts.get(("decode", "FULL"), 0) > 0
    with pytest.raises(ValueError, match="^logit_bias: token id"):
        llm.generate(["x"], SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
