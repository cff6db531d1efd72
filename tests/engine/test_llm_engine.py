"""LLMEngine step by step: chunked prefill, preemption, prefix caching, abort, EOS rules
and KV block accounting must never change what a request generates.

The reference is an engine with an ample KV cache, prefix caching off and a large token
budget, on the same real model (stories260K), in eager mode.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from decodegraph import LLM, RequestOutput, SamplingParams
from decodegraph.engine.llm_engine import LLMEngine
from decodegraph.request import Request
from decodegraph.sampling_params import RequestOutputKind
from tests.utils.checkpoints import make_checkpoint
from tests.utils.requests import greedy

GREEDY = greedy(24, ignore_eos=False)
# Token ids of a story-like prompt (BOS first), cut to any length by prompt().
_STORY = (
    [1, 403, 407, 261, 378, 17, 300, 383, 261, 438, 463, 280, 263, 443, 311, 275, 393]
    + [330, 356, 269, 379, 261, 296, 346, 374, 421, 260, 321, 289, 278, 398, 324]
) * 4


def prompt(length: int, offset: int = 0) -> list[int]:
    """`length` ids: BOS, then story tokens from `offset` (distinct offsets, no shared prefix)."""
    return [1, *_STORY[1 + offset : offset + length]]


def make_engine(model: Path, **kwargs: Any) -> LLMEngine:
    args = {"enforce_eager": True, "max_model_len": 256, "max_num_seqs": 16, **kwargs}
    return LLM(str(model), **args).llm_engine


def run(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams] = GREEDY,
) -> tuple[list[RequestOutput], list[Request], int]:
    """Add every prompt, step until done; return the final outputs in order, the
    scheduler's Request objects (for their preemption counts) and the step count."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params_list, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    requests = list(engine.scheduler.requests.values())
    finished: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[rid] for rid in ids], requests, steps


def ids_of(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


@pytest.fixture(scope="module")
def ref(stories_dir: Path) -> LLMEngine:
    return make_engine(stories_dir, enable_prefix_caching=False)


def reference_ids(
    ref: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    """Each prompt run alone in the reference engine."""
    return [ids_of(run(ref, [p], params)[0])[0] for p in prompts]


def test_chunked_prefill_spreads_a_long_prompt_over_steps_without_changing_ids(
    stories_dir: Path, ref: LLMEngine
) -> None:
    engine = make_engine(stories_dir, max_num_batched_tokens=16, max_num_seqs=8)
    long = prompt(70)
    outs, _, steps = run(engine, [long], greedy(8, ignore_eos=False))
    assert steps == 5 + 7  # ceil(70 / 16) prefill chunks, the last samples; 7 decodes
    assert ids_of(outs) == reference_ids(ref, [long], greedy(8, ignore_eos=False))
    # Several long prompts at once: chunks of prefills share steps with decodes.
    prompts = [prompt(n, off) for n, off in ((70, 0), (5, 3), (41, 7), (23, 11))]
    assert ids_of(run(engine, prompts)[0]) == reference_ids(ref, prompts)
    assert_all_blocks_free(engine)


def test_large_decode_batches_beside_one_token_prefill_chunks_do_not_change_ids(
    stories_dir: Path, ref: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 requests decode together while a 41st prompt gets the one token left in the
    budget each step: a batch of one token per request in which one row does not sample
    until its prompt is done."""
    engine = make_engine(stories_dir, max_num_seqs=48, max_num_batched_tokens=41)
    runner = engine.runner
    batches: list[tuple[int, int]] = []
    original = runner._prepare_inputs

    def spy(so, states, plan):  # noqa: ANN001, ANN202
        batches.append((so.num_reqs, so.total_num_scheduled_tokens))
        return original(so, states, plan)

    monkeypatch.setattr(runner, "_prepare_inputs", spy)
    prompts = [prompt(2 + i % 3, i) for i in range(40)] + [prompt(30, 5)]
    params = greedy(40, ignore_eos=False)
    assert ids_of(run(engine, prompts, params)[0]) == reference_ids(ref, prompts, params)
    assert batches.count((41, 41)) >= 20
    assert_all_blocks_free(engine)


def test_two_intra_op_threads_give_the_ids_of_one(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch, restore_threads: None
) -> None:
    """The prefill step of 64 prompts is large enough for the attention operator to split
    its requests, and the row-wise operators their rows, over two threads: same ids."""
    prompts = [prompt(20 + i % 13, i) for i in range(64)]
    params = greedy(24, ignore_eos=False)
    ids = []
    for n in (1, 2):
        monkeypatch.setenv("DECODEGRAPH_CPU_THREADS", str(n))
        engine = make_engine(stories_dir, max_num_seqs=64)
        assert torch.get_num_threads() == n
        ids.append(ids_of(run(engine, prompts, params)[0]))
    assert ids[0] == ids[1]


# 128 tokens need 8 blocks of 16 (+ the null block): 10 is a little over one sequence.
# In bytes: exactly 10 blocks of 20480 (kv_cache_memory_bytes is the KV cache size, as in vLLM).
TINY_KV_BUDGETS = [
    {"num_gpu_blocks_override": 10},
    {"kv_cache_memory_bytes": 10 * 20480},
]


@pytest.mark.parametrize("budget", TINY_KV_BUDGETS, ids=["blocks", "bytes"])
def test_preemption_under_a_tiny_kv_cache_does_not_change_ids(
    budget: dict[str, int], stories_dir: Path, ref: LLMEngine
) -> None:
    engine = make_engine(stories_dir, max_model_len=128, **budget)
    assert engine.get_stats().num_blocks == 9
    prompts = [prompt(n, off) for n, off in ((20, 0), (33, 2), (9, 5), (27, 9), (40, 13), (15, 1))]
    params = greedy(40, ignore_eos=False)
    outs, requests, _ = run(engine, prompts, params)
    assert sum(r.num_preemptions for r in requests) > 0
    assert requests[0].num_preemptions == 0  # the victim is always the latest arrival
    assert ids_of(outs) == reference_ids(ref, prompts, params)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_all_blocks_free(engine)


def test_preempted_seeded_requests_keep_their_samples(stories_dir: Path, ref: LLMEngine) -> None:
    engine = make_engine(stories_dir, max_model_len=128, num_gpu_blocks_override=10)
    prompts = [prompt(n, off) for n, off in ((20, 0), (33, 2), (27, 9), (40, 13))]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40) for i in range(4)]
    outs, requests, _ = run(engine, prompts, params)
    assert sum(r.num_preemptions for r in requests) > 0
    want = [ids_of(run(ref, [p], sp)[0])[0] for p, sp in zip(prompts, params, strict=True)]
    assert ids_of(outs) == want
    assert_all_blocks_free(engine)


def test_chunked_prefill_preemption_and_prefix_hits_together_do_not_change_ids(
    stories_dir: Path, ref: LLMEngine
) -> None:
    engine = make_engine(
        stories_dir, max_model_len=128, num_gpu_blocks_override=10, max_num_batched_tokens=16
    )
    rng = random.Random(0)
    shared = prompt(40, 2)
    prompts, params = [], []
    for i in range(10):
        if i % 3 == 0:  # a shared prefix of at least one full block
            prompts.append(shared[: rng.randint(17, 40)] + [rng.randint(3, 500)])
        else:
            prompts.append(prompt(rng.randint(2, 60), rng.randint(0, 30)))
        max_tokens = rng.randint(5, 50)
        params.append(
            greedy(max_tokens, ignore_eos=False)
            if i % 2
            else SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens)
        )
    outs, requests, _ = run(engine, prompts, params)
    assert sum(r.num_preemptions for r in requests) > 0
    assert engine.get_stats().prefix_cache_hits > 0
    want = [ids_of(run(ref, [p], sp)[0])[0] for p, sp in zip(prompts, params, strict=True)]
    assert ids_of(outs) == want
    assert_all_blocks_free(engine)


def test_prefix_cache_hits_are_counted_and_do_not_change_ids(
    stories_dir: Path, ref: LLMEngine
) -> None:
    engine = make_engine(stories_dir)
    shared = prompt(70)
    first, _, _ = run(engine, [shared])
    hits_before = engine.get_stats().prefix_cache_hits
    assert first[0].num_cached_tokens == 0
    # The same prefix with a different tail, and the very same prompt again.
    longer = shared + [300, 383, 261]
    outs, _, _ = run(engine, [longer, shared])
    stats = engine.get_stats()
    assert stats.prefix_cache_hits >= hits_before + 2 * 64
    assert [o.num_cached_tokens for o in outs] == [64, 64]
    assert ids_of(outs) == reference_ids(ref, [longer, shared])
    assert ids_of(first) == ids_of(outs[1:])
    assert_all_blocks_free(engine)


def test_block_aligned_prompt_fully_in_the_cache_still_computes_its_last_token(
    stories_dir: Path, ref: LLMEngine
) -> None:
    engine = make_engine(stories_dir)
    aligned = prompt(64, 4)  # exactly 4 full blocks
    first = ids_of(run(engine, [aligned])[0])
    again, _, _ = run(engine, [aligned])
    assert again[0].num_cached_tokens == 48  # the last block is recomputed for its logits
    assert ids_of(again) == first == reference_ids(ref, [aligned])
    assert_all_blocks_free(engine)


def test_abort_mid_way_frees_every_block_and_leaves_others_unchanged(
    stories_dir: Path, ref: LLMEngine
) -> None:
    engine = make_engine(stories_dir, max_num_seqs=2)  # r2, r3 wait while r0, r1 run
    prompts = [prompt(n, off) for n, off in ((30, 0), (12, 4), (50, 8), (20, 2))]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    engine.add_request("n3", {"prompt_token_ids": prompts[1]}, SamplingParams(n=3, max_tokens=24))
    for _ in range(3):
        engine.step()
    assert engine.get_stats().num_free_blocks < engine.get_stats().num_blocks
    engine.abort_request(["r1", "r2", "n3", "unknown-id"])  # running, waiting, n>1 parent
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id in ("r0", "r3")
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["r0", "r3"]
    assert ids_of([finished["r0"], finished["r3"]]) == reference_ids(ref, prompts[::3])
    assert_all_blocks_free(engine)


def test_aborting_everything_frees_every_block(stories_dir: Path) -> None:
    engine = make_engine(stories_dir)
    for i in range(5):
        engine.add_request(str(i), {"prompt_token_ids": prompt(20 + 7 * i, i)}, GREEDY)
    engine.step()
    engine.step()
    engine.abort_request([str(i) for i in range(5)])
    assert engine.step() == []
    assert_all_blocks_free(engine)


def test_too_long_prompt_fails_alone_and_the_engine_serves_on(
    stories_dir: Path, ref: LLMEngine
) -> None:
    engine = make_engine(stories_dir)
    good = prompt(30)
    engine.add_request("good", {"prompt_token_ids": good}, GREEDY)
    with pytest.raises(ValueError, match=r"300 tokens .* max_model_len=256"):
        engine.add_request("long", {"prompt_token_ids": [1] * 300}, GREEDY)
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["good"]
    assert ids_of(outs) == reference_ids(ref, [good])
    engine.add_request("long", {"prompt_token_ids": prompt(40)}, GREEDY)  # the id is free
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_seeded_request_added_mid_run_samples_as_alone(stories_dir: Path, ref: LLMEngine) -> None:
    engine = make_engine(stories_dir)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=24)
    engine.add_request("a", {"prompt_token_ids": prompt(12)}, SamplingParams(temperature=1.0))
    engine.step()
    engine.step()
    engine.add_request("b", {"prompt_token_ids": prompt(25, 3)}, seeded)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert ids_of([finished["b"]]) == reference_ids(ref, [prompt(25, 3)], seeded)


@pytest.fixture(scope="module")
def eos_llm(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, list[int], int]:
    """A tiny random checkpoint whose EOS is its greedy output's 4th token for PROMPT."""
    root = tmp_path_factory.mktemp("eos")
    kwargs = {"skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 128}
    plain = LLM(str(make_checkpoint(root / "plain", "llama-gqa")), **kwargs)
    outs = plain.generate({"prompt_token_ids": EOS_PROMPT}, GREEDY, use_tqdm=False)
    ids = outs[0].outputs[0].token_ids
    eos = next(t for t in ids[3:] if t != 1)
    llm = LLM(str(make_checkpoint(root / "eos", "llama-gqa", eos_token_id=eos)), **kwargs)
    return llm, ids, eos


EOS_PROMPT = [1, 17, 42, 99, 5, 63]


def test_eos_finishes_with_stop_and_no_stop_reason(eos_llm: tuple[LLM, list[int], int]) -> None:
    llm, greedy_ids, eos = eos_llm
    out = llm.generate({"prompt_token_ids": EOS_PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_ids[: greedy_ids.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_min_tokens_suppresses_eos_until_reached(eos_llm: tuple[LLM, list[int], int]) -> None:
    llm, greedy_ids, eos = eos_llm
    min_tokens = greedy_ids.index(eos) + 6
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=min_tokens)
    out = llm.generate({"prompt_token_ids": EOS_PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= min_tokens
    assert eos not in out.token_ids[:min_tokens]


def test_ignore_eos_runs_to_max_tokens(eos_llm: tuple[LLM, list[int], int]) -> None:
    llm, greedy_ids, eos = eos_llm
    params = greedy(24)
    out = llm.generate({"prompt_token_ids": EOS_PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_ids  # the same ids as the checkpoint without an EOS there
    assert out.finish_reason == "length"


def test_every_eos_id_of_a_list_stops_generation(
    eos_llm: tuple[LLM, list[int], int], tmp_path: Path
) -> None:
    # Llama 3.x and Qwen2 instruct models list several EOS ids (e.g. <|eot_id|> second).
    _, greedy_ids, eos = eos_llm
    path = make_checkpoint(tmp_path, "llama-gqa", eos_token_id=[127, eos])
    llm = LLM(str(path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128)
    out = llm.generate({"prompt_token_ids": EOS_PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_ids[: greedy_ids.index(eos) + 1]
    assert out.finish_reason == "stop"
    min_tokens = greedy_ids.index(eos) + 6
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=min_tokens)
    out = llm.generate({"prompt_token_ids": EOS_PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert eos not in out.token_ids[:min_tokens]
    ignore = greedy(24)
    out = llm.generate({"prompt_token_ids": EOS_PROMPT}, ignore, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_ids


def test_stop_strings_without_a_tokenizer_are_refused(eos_llm: tuple[LLM, list[int], int]) -> None:
    # With skip_tokenizer_init there is no text to match: ignoring them would run silently
    # to max_tokens (vLLM #46310).
    llm = eos_llm[0]
    with pytest.raises(ValueError, match="^stop: .*tokenizer"):
        llm.generate({"prompt_token_ids": EOS_PROMPT}, SamplingParams(stop=["x"]), use_tqdm=False)
    assert_all_blocks_free(llm.llm_engine)


def test_final_only_requests_show_nothing_until_the_end_and_match_cumulative(
    ref: LLMEngine,
) -> None:
    """LLM.generate's requests (FINAL_ONLY, no stop strings, no logprobs) pass through
    the scheduler and the output processor once, at the end: same ids, text, finish
    reason and timings' order as a CUMULATIVE run, and the generated-token statistic
    (Prometheus' generation_tokens) still advances every step."""
    prompts = [prompt(9), prompt(5, offset=11)]
    cumulative, _, _ = run(ref, prompts)
    final_only = RequestOutputKind.FINAL_ONLY
    final = SamplingParams(temperature=0.0, max_tokens=24, output_kind=final_only)
    for i, p in enumerate(prompts):
        ref.add_request(f"f{i}", {"prompt_token_ids": p}, final)
    before = ref.get_stats().generation_tokens_total
    shown: list[RequestOutput] = []
    counts = []
    while ref.has_unfinished_requests():
        shown += ref.step()
        counts.append(ref.get_stats().generation_tokens_total - before)
    assert counts[:3] == [2, 4, 6] and counts[-1] == 48
    assert [o.request_id for o in shown] == ["f0", "f1"] and all(o.finished for o in shown)
    for got, want in zip(shown, cumulative, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason == "length"
        m = got.metrics
        assert m.first_scheduled_time <= m.first_token_time < m.last_token_time
    assert_all_blocks_free(ref)


def test_start_up_logs_each_phase_with_its_seconds(
    stories_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="decodegraph.engine.core")
    engine = make_engine(stories_dir)
    assert list(engine.engine_core.startup_seconds) == ["load", "profile", "KV cache", "capture"]
    assert all(seconds >= 0 for seconds in engine.engine_core.startup_seconds.values())
    (line,) = [r.getMessage() for r in caplog.records if "Engine ready" in r.getMessage()]
    for phase in ("load", "profile", "KV cache", "capture"):
        assert f"{phase} " in line and " s" in line


def _stop_string_in(text: str, start: int) -> str:
    """A 3-character piece of `text` that first occurs at or after `start`."""
    for i in range(start, len(text) - 3):
        piece = text[i : i + 3]
        if text.find(piece) == i:
            return piece
    raise AssertionError(f"no fresh 3-character piece in {text!r}")


def test_multi_step_batches_change_no_ids_text_logprobs_or_stops(
    stories_dir: Path, ref: LLMEngine
) -> None:
    """num_scheduler_steps=6 against single steps: greedy, seeded, logprobs, streaming
    deltas, and a stop string completed inside a batch of steps (the tokens after it
    are dropped), on the real model; every block free afterwards."""
    prompts = [prompt(9), prompt(5, offset=11), prompt(17, offset=3)]
    text = run(ref, [prompts[0]], greedy(40, ignore_eos=False))[0][0].outputs[0].text
    stop = _stop_string_in(text, 30)
    cases = [
        greedy(30, ignore_eos=False),
        SamplingParams(temperature=0.9, seed=7, max_tokens=30),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]),
    ]
    multi = make_engine(stories_dir, num_scheduler_steps=6)
    for params in cases:
        want, _, want_steps = run(ref, prompts, params)
        got, _, got_steps = run(multi, prompts, params)
        for g, w in zip(got, want, strict=True):
            g, w = g.outputs[0], w.outputs[0]
            assert (g.token_ids, g.finish_reason, g.stop_reason) == (
                w.token_ids,
                w.finish_reason,
                w.stop_reason,
            )
            assert g.text == w.text
            if params.logprobs:
                assert [list(lp) for lp in g.logprobs] == [list(lp) for lp in w.logprobs]
                assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob)
        assert got_steps < want_steps
    assert want[0].outputs[0].stop_reason == stop  # the stop string did stop it
    # Streamed deltas arrive in bursts and join to the same tokens and text.
    delta = SamplingParams(temperature=0.0, max_tokens=30, output_kind=RequestOutputKind.DELTA)
    for i, p in enumerate(prompts):
        multi.add_request(f"d{i}", {"prompt_token_ids": p}, delta)
    joined: dict[str, tuple[list[int], str]] = {f"d{i}": ([], "") for i in range(len(prompts))}
    sizes = set()
    while multi.has_unfinished_requests():
        for out in multi.step():
            ids, text = joined[out.request_id]
            joined[out.request_id] = (ids + out.outputs[0].token_ids, text + out.outputs[0].text)
            sizes.add(len(out.outputs[0].token_ids))
    want = run(ref, prompts, greedy(30, ignore_eos=False))[0]
    for i, w in enumerate(want):
        assert joined[f"d{i}"] == (w.outputs[0].token_ids, w.outputs[0].text)
    assert max(sizes) == 6
    assert_all_blocks_free(multi)


def test_eos_inside_a_multi_step_batch_ends_the_request_there(tmp_path: Path) -> None:
    """The checkpoint's EOS is its greedy output's 4th token or later: with 8 steps per
    batch the steps after it run, and their tokens are dropped."""
    kwargs = {"skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 128}
    plain = LLM(str(make_checkpoint(tmp_path / "plain", "llama-gqa")), **kwargs)
    ids = plain.generate({"prompt_token_ids": EOS_PROMPT}, GREEDY, use_tqdm=False)[0]
    ids = ids.outputs[0].token_ids
    eos = next(t for t in ids[3:] if t != 1)
    path = make_checkpoint(tmp_path / "eos", "llama-gqa", eos_token_id=eos)
    llm = LLM(str(path), num_scheduler_steps=8, **kwargs)
    out = llm.generate({"prompt_token_ids": EOS_PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: ids.index(eos) + 1] and out.finish_reason == "stop"
    assert_all_blocks_free(llm.llm_engine)


def test_a_reused_request_id_gets_its_own_block_table_row(stories_dir: Path) -> None:
    """Request ids r0..r2 again, after a run in which a stop string ended r0 early (so
    the next run's blocks differ from the last one's): each row of the block table is
    rewritten for the new request, never kept as the finished one with that id left it."""
    engine = make_engine(stories_dir, enable_prefix_caching=False)
    prompts = [prompt(9), prompt(5, offset=11), prompt(17, offset=3)]
    text = run(engine, [prompts[0]], greedy(40, ignore_eos=False))[0][0].outputs[0].text
    want = ids_of(run(engine, prompts)[0])
    stopped = SamplingParams(temperature=0.0, max_tokens=40, stop=[_stop_string_in(text, 30)])
    assert run(engine, prompts, stopped)[0][0].outputs[0].finish_reason == "stop"
    assert ids_of(run(engine, prompts)[0]) == want


def test_after_a_failed_step_the_runner_says_the_engine_failed(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from decodegraph.engine.core import EngineDeadError

    engine = make_engine(stories_dir)
    engine.add_request("a", {"prompt_token_ids": prompt(4)}, greedy(4))

    def out_of_memory(*args: Any) -> Any:
        raise torch.OutOfMemoryError("no memory left")

    monkeypatch.setattr(engine.runner, "execute_model", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        engine.step()
    with pytest.raises(EngineDeadError, match="no memory left"):
        engine.runner  # noqa: B018
    with pytest.raises(EngineDeadError, match="no memory left"):
        engine.step()
