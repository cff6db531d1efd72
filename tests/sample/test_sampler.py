"""The sampler on hand-made logits: greedy, filters, seeds, penalties, min_tokens,
logprobs and the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from decodegraph.sample import sampler
from decodegraph.sample.metadata import BatchStaticsCache, SamplingMetadata, SamplingRequest
from decodegraph.sample.sampler import Sampler, apply_penalties
from tests.utils.requests import make_request_state

VOCAB = 32


def sample(logits: torch.Tensor, requests: list[SamplingRequest]):
    md = SamplingMetadata.from_requests(requests, logits.shape[1], "cpu")
    return Sampler()(logits, md)


def test_greedy_is_argmax_and_takes_the_fast_path() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB)
    reqs = [make_request_state(str(i), temperature=0.0) for i in range(5)]
    md = SamplingMetadata.from_requests(reqs, VOCAB, "cpu")
    assert md.is_fast_greedy
    out = Sampler()(logits, md)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("shape", [(1, 512), (256, 512), (3, 151936)])
def test_greedy_takes_the_cpu_argmax_operator_for_large_logits(
    cpu_ops: object, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int]
) -> None:
    """Many ties (the first maximum wins) and a NaN row: the same ids as torch's max(dim),
    through the native operator wherever the logits are large enough for it."""
    calls = []
    real = cpu_ops.argmax_rows
    monkeypatch.setattr(
        sampler.native,
        "cpu_ops_for",
        lambda x: type("Ops", (), {"argmax_rows": lambda _, t: calls.append(1) or real(t)})(),
    )
    logits = torch.randint(0, 4, shape, generator=torch.Generator().manual_seed(0)).float()
    logits[-1, shape[1] // 3] = float("nan")
    assert sampler.greedy(logits).tolist() == logits.max(dim=-1).indices.tolist()
    assert len(calls) == (logits.numel() >= sampler.NATIVE_ARGMAX_MIN_VALUES)


def test_metadata_statics_are_reused_for_the_same_batch_within_one_cache() -> None:
    reqs = [make_request_state(str(i), temperature=0.7, top_k=3) for i in range(3)]
    cache = BatchStaticsCache()
    a = SamplingMetadata.from_requests(reqs, VOCAB, "cpu", cache)
    b = SamplingMetadata.from_requests(reqs, VOCAB, "cpu", cache)
    assert a.statics is b.statics
    c = SamplingMetadata.from_requests(reqs[:2], VOCAB, "cpu", cache)
    assert c.statics is not a.statics
    assert c.statics.temperature is not None and c.statics.temperature.shape == (2,)
    # Another runner's cache (or none) shares nothing with this one.
    assert (
        SamplingMetadata.from_requests(reqs, VOCAB, "cpu", BatchStaticsCache()).statics
        is not a.statics
    )
    assert SamplingMetadata.from_requests(reqs, VOCAB, "cpu").statics is not a.statics


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_filters_that_keep_one_token_equal_greedy(params: dict) -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    reqs = [make_request_state(str(i), temperature=1.5, **params) for i in range(4)]
    for _ in range(5):
        assert sample(logits, reqs).sampled_token_ids == logits.argmax(-1).tolist()


def test_top_k_only_draws_from_the_k_best() -> None:
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0) * 0.01
    req = make_request_state(temperature=1.0, top_k=3)
    drawn = {sample(logits, [req]).sampled_token_ids[0] for _ in range(200)}
    assert drawn == {VOCAB - 1, VOCAB - 2, VOCAB - 3}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # probs 0.5, 0.3, 0.2 (and ~0 elsewhere): p=0.7 keeps the first two only.
    logits = torch.full((1, VOCAB), -1e9)
    logits[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    req = make_request_state(temperature=1.0, top_p=0.7)
    drawn = {sample(logits, [req]).sampled_token_ids[0] for _ in range(300)}
    assert drawn == {0, 1}


def test_seeded_requests_reproduce_and_ignore_batch_composition() -> None:
    torch.manual_seed(2)
    steps = [torch.randn(4, VOCAB) for _ in range(6)]

    def run(batch_rows: list[int], with_others: bool) -> list[int]:
        seeded = make_request_state("s", temperature=1.0, seed=1234)
        others = [make_request_state(f"o{i}", temperature=0.8) for i in range(3)]
        greedy = make_request_state("g", temperature=0.0)
        tokens = []
        for logits in steps:
            reqs = [others[0], seeded, greedy, others[1]] if with_others else [seeded]
            rows = logits[batch_rows] if with_others else logits[1:2]
            out = sample(rows, reqs)
            tokens.append(out.sampled_token_ids[reqs.index(seeded)])
        return tokens

    alone = run([0], with_others=False)
    assert alone == run([0, 1, 2, 3], with_others=True)
    assert alone == run([0], with_others=False)


def test_different_seeds_give_different_samples() -> None:
    logits = torch.zeros(1, VOCAB)
    a = [
        sample(logits, [make_request_state(temperature=1.0, seed=s)]).sampled_token_ids[0]
        for s in range(20)
    ]
    assert len(set(a)) > 5


def test_temperature_sampling_matches_a_two_token_distribution() -> None:
    # p(0)=0.8, p(1)=0.2 at T=1; at T=2 the logits halve: p(0)=2/3 (sqrt 4 : sqrt 1).
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 0], logits[0, 1] = math.log(0.8), math.log(0.2)
    torch.manual_seed(3)
    for temperature, expected in ((1.0, 0.8), (2.0, 2 / 3)):
        req = make_request_state(temperature=temperature)
        batch = logits.expand(4000, VOCAB).contiguous()
        md = SamplingMetadata.from_requests([req] * 4000, VOCAB, "cpu")
        ids = Sampler()(batch, md).sampled_token_ids
        assert set(ids) <= {0, 1}
        assert abs(ids.count(0) / len(ids) - expected) < 0.03


def test_penalties_change_logits_as_specified() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    # prompt has token 0; output has token 1 twice and token 2 once.
    req = make_request_state(
        prompt=[0],
        output=[1, 1, 2],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    md = SamplingMetadata.from_requests([req], 6, "cpu")
    edited = logits.clone()
    apply_penalties(edited, md)
    expected = torch.tensor(
        [
            [
                2.0 / 2,  # prompt token, positive: divided; no presence/frequency (prompt only)
                -2.0 * 2 - 0.5 - 0.25 * 2,  # output twice, negative: multiplied
                1.0 / 2 - 0.5 - 0.25,  # output once
                -1.0,
                0.5,
                3.0,
            ]
        ]
    )
    torch.testing.assert_close(edited, expected)


def test_repetition_penalty_steers_greedy_away_from_repeats() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    plain = make_request_state(temperature=0.0, prompt=[3], output=[0])
    penalised = make_request_state(temperature=0.0, prompt=[3], output=[0], repetition_penalty=2.0)
    assert sample(torch.cat([logits, logits]), [plain, penalised]).sampled_token_ids == [0, 1]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0  # EOS is the best token
    logits[0, 7] = 9.0  # then a stop token
    before = make_request_state(
        eos=2, temperature=0.0, min_tokens=2, stop_token_ids=[7], output=[5]
    )
    reached = make_request_state(
        eos=2, temperature=0.0, min_tokens=2, stop_token_ids=[7], output=[5, 5]
    )
    out = sample(torch.cat([logits, logits]), [before, reached])
    assert out.sampled_token_ids[1] == 2
    assert out.sampled_token_ids[0] not in (2, 7)


def test_logprobs_match_log_softmax_with_ranks() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB)
    reqs = [
        make_request_state("a", temperature=0.0, logprobs=3),
        make_request_state("b", temperature=1.0, logprobs=0, top_k=5),
        make_request_state("c", temperature=0.0),
    ]
    out = sample(logits, reqs)
    assert out.logprobs is not None and out.logprobs[2] is None
    ref = torch.log_softmax(logits, dim=-1)
    order = ref.argsort(dim=-1, descending=True).tolist()
    for row, k in ((0, 3), (1, 0)):
        entry = out.logprobs[row]
        assert entry is not None
        token = out.sampled_token_ids[row]
        assert token in entry
        expected_ids = set(order[row][:k]) | {token}
        assert set(entry) == expected_ids
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[row, tid].item(), abs=1e-6)
            assert lp.rank == order[row].index(tid) + 1
    assert out.sampled_token_ids[0] == order[0][0]
    assert out.logprobs[0][order[0][0]].rank == 1


def test_sampler_does_not_modify_the_logits() -> None:
    torch.manual_seed(5)
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    reqs = [
        make_request_state(
            "a", temperature=0.9, top_p=0.5, min_p=0.1, output=[1], presence_penalty=1.0
        ),
        make_request_state("b", temperature=0.0, min_tokens=3, eos=0, logprobs=2),
    ]
    sample(logits, reqs)
    assert torch.equal(logits, before)
