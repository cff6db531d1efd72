"""`SamplingParams.prompt_logprobs` end to end on stories260K: vLLM's shape, equal to
transformers' logprobs on the same weights, with chunked prefill, after a prefix-cache
hit, with n > 1, in every graph mode, and texts that concatenate to the prompt."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from decodegraph.entrypoints.llm import LLM
from decodegraph.sampling_params import SamplingParams
from tests.utils.reference import transformers_logprobs

PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play.",
    "The cat sat on the mat.",
    "Tom had a red ball",
]
ALL_MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@pytest.fixture(scope="module")
def reference(stories_dir: Path) -> Callable[[list[int]], torch.Tensor]:
    """transformers' log-softmax over the vocabulary at every position of a prompt."""
    return transformers_logprobs(stories_dir)


@pytest.fixture(scope="module")
def engines(stories_dir: Path) -> Iterator[Callable[..., LLM]]:
    cache: dict[tuple, LLM] = {}

    def get(mode: str = "NONE", **kwargs: object) -> LLM:
        key = (mode, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = LLM(
                str(stories_dir),
                compilation_config={
                    "cudagraph_mode": mode,
                    "cudagraph_capture_sizes": [1, 4, 8],
                    "use_inductor": False,
                },
                max_model_len=128,
                **kwargs,
            )
        return cache[key]

    yield get
    cache.clear()


def _check(llm: LLM, prompt: str, out: object, k: int, reference: Callable) -> None:
    ids = llm.get_tokenizer().encode(prompt)
    assert out.prompt_token_ids == ids
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(ids) and pl[0] is None
    ref = reference(ids)
    for p in range(1, len(ids)):
        entry = pl[p]
        assert ids[p] in entry
        assert len(entry) in (k, k + 1)
        got = entry[ids[p]]
        want = ref[p - 1, ids[p]].item()
        assert got.logprob == pytest.approx(want, abs=1e-4)
        assert got.rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        top = ref[p - 1].topk(k)
        for rank, (lp, tid) in enumerate(zip(top.values, top.indices, strict=True), 1):
            assert entry[int(tid)].logprob == pytest.approx(lp.item(), abs=1e-4)
            if int(tid) != ids[p]:
                assert entry[int(tid)].rank == rank
    # Each prompt token's text is its piece in context: they concatenate to the prompt.
    assert "".join(pl[p][ids[p]].decoded_token for p in range(1, len(ids))) == prompt


def test_prompt_logprobs_equal_transformers_with_chunked_prefill(
    engines: Callable[..., LLM], reference: Callable
) -> None:
    llm = engines(max_num_batched_tokens=8, enable_chunked_prefill=True)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        _check(llm, prompt, out, 4, reference)
        assert len(out.outputs[0].token_ids) == 3


def test_prompt_logprobs_are_computed_after_a_prefix_cache_hit(
    engines: Callable[..., LLM], reference: Callable
) -> None:
    llm = engines(enable_prefix_caching=True)
    prompt = PROMPTS[0] + " " + PROMPTS[0]  # more than a block
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    again = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the prompt's blocks are cached
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert out[0].num_cached_tokens == 0  # a request with prompt logprobs reads no cache
    _check(llm, prompt, out[0], 0, reference)


def test_prompt_logprobs_once_per_request_with_n(
    engines: Callable[..., LLM], reference: Callable
) -> None:
    llm = engines()
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, prompt_logprobs=1)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    _check(llm, PROMPTS[1], out, 1, reference)


def test_no_prompt_logprobs_unless_asked(engines: Callable[..., LLM]) -> None:
    out = engines().generate([PROMPTS[2]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None


def test_one_token_prompt_has_only_none(engines: Callable[..., LLM]) -> None:
    params = SamplingParams(max_tokens=2, prompt_logprobs=2)
    out = engines().generate([[1]], params, use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_prompt_logprobs_in_every_graph_mode(
    engines: Callable[..., LLM], reference: Callable, mode: str
) -> None:
    """Seven decoding requests leave one token of an 8-token budget to a prompt, which is
    then fed one token per step: uniform steps whose prompt row does not sample (a full
    graph returns only per-row logits there) and mixed steps; the prompt logprobs are the
    same in every mode."""
    llm = engines(mode, max_num_batched_tokens=8, enable_chunked_prefill=True, max_num_seqs=8)
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    wanted = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    before = dict(llm.llm_engine.runner.graph_runner.mode_counts)
    outs = llm.generate([[1]] * 7 + PROMPTS, [plain] * 7 + [wanted] * 3, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs[7:], strict=True):
        _check(llm, prompt, out, 3, reference)
    assert outs[0].prompt_logprobs is None
    counts = llm.llm_engine.runner.graph_runner.mode_counts
    ran = {key for key, n in counts.items() if n > before.get(key, 0)}
    if mode != "NONE":
        graph = "PIECEWISE" if mode == "PIECEWISE" else "FULL"
        assert any(m == graph for _, m in ran), ran


def test_prompt_logprobs_scored_in_slices(
    engines: Callable[..., LLM], reference: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    from decodegraph.worker import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "_SLICE", 3)
    llm = engines()
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        _check(llm, prompt, out, 2, reference)


def test_prompt_logprobs_survive_preemption(
    engines: Callable[..., LLM], reference: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nine usable blocks of 16 tokens: a short request decodes while a prompt of about
    120 tokens is fed 15 tokens a step, until the long one cannot get a block and is
    preempted before its first token (then again after it, as the short one grows); it
    recomputes, and each position's logprob is computed once and right."""
    from decodegraph.core.scheduler import Scheduler

    preempted: list[tuple[str, int]] = []
    original = Scheduler._preempt

    def counting(self: Scheduler, request: object) -> None:
        preempted.append((request.request_id, request.num_output_tokens))
        original(self, request)

    monkeypatch.setattr(Scheduler, "_preempt", counting)
    llm = engines(
        max_num_batched_tokens=16,
        enable_chunked_prefill=True,
        num_gpu_blocks_override=10,
        max_num_seqs=4,
    )
    tokenizer = llm.get_tokenizer()
    long_prompt = " ".join(PROMPTS * 3)
    while len(tokenizer.encode(long_prompt)) > 120:
        long_prompt = long_prompt.rsplit(" ", 1)[0]
    short = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    long = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    outs = llm.generate([PROMPTS[1], long_prompt], [short, long], use_tqdm=False)
    assert any(outputs == 0 for _, outputs in preempted), preempted
    _check(llm, PROMPTS[1], outs[0], 1, reference)
    _check(llm, long_prompt, outs[1], 2, reference)


def test_minus_one_is_the_whole_vocabulary_of_transformers(
    engines: Callable[..., LLM], reference: Callable
) -> None:
    """vLLM's -1: every token of the vocabulary at every prompt position, each with its
    rank, and for generated tokens too; allowed by max_logprobs=-1 (no cap)."""
    llm = engines(max_logprobs=-1)
    vocab = llm.llm_engine.vocab_size
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=-1, logprobs=-1)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    ref = reference(ids)
    for p, entry in enumerate(out.prompt_logprobs[1:], 1):
        assert len(entry) == vocab
        got = torch.tensor([entry[t].logprob for t in range(vocab)])
        torch.testing.assert_close(got, ref[p - 1].float(), atol=1e-4, rtol=0)
        # The prompt token's rank counts the better ones; every other token's is its
        # place in the order, so the others' ranks are distinct and follow the logprobs.
        own = entry[ids[p]]
        assert own.rank == int((got > own.logprob).sum()) + 1
        others = sorted((lp.rank, lp.logprob) for t, lp in entry.items() if t != ids[p])
        assert len({r for r, _ in others}) == vocab - 1 and others[-1][0] <= vocab
        assert all(a[1] >= b[1] for a, b in zip(others, others[1:], strict=False))
    texts = "".join(out.prompt_logprobs[p][ids[p]].decoded_token for p in range(1, len(ids)))
    assert texts == PROMPTS[1]
    (generated,) = out.outputs
    assert [len(e) for e in generated.logprobs] == [vocab, vocab]
    assert all(e[t].rank == 1 for t, e in zip(generated.token_ids, generated.logprobs, strict=True))


def test_logprobs_beyond_max_logprobs_are_refused_naming_the_field(
    engines: Callable[..., LLM],
) -> None:
    """The default max_logprobs is vLLM's 20: -1 (the whole vocabulary, 512 here) or 21
    is refused before anything is queued; a raised limit admits them."""
    llm = engines()
    for name, value in (("prompt_logprobs", -1), ("prompt_logprobs", 21), ("logprobs", -1)):
        with pytest.raises(ValueError, match=rf"^{name}: .*max_logprobs=20"):
            llm.generate(["Tom"], SamplingParams(max_tokens=1, **{name: value}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    wide = engines(max_logprobs=30)
    out = wide.generate(
        ["Tom had"], SamplingParams(max_tokens=1, prompt_logprobs=25), use_tqdm=False
    )
    assert all(len(e) in (25, 26) for e in out[0].prompt_logprobs[1:])
    with pytest.raises(ValueError, match="^prompt_logprobs: "):
        wide.generate(["Tom"], SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False)
