"""Every graph mode end to end (docs/design.md §7 invariants 1, 3, 5, 6): greedy ids equal mode
NONE's on stories260K and on random Llama (GQA) and Qwen3 checkpoints, for batch sizes
that need padding, mixed prompt lengths, chunked prefill, preemption and prefix-cache hits;
graph counts per mode on a real engine; the `decodegraph graphs` CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from decodegraph.attention.backends.torch_paged import CPUAttentionBackend
from decodegraph.benchmarks.accuracy import check_logprobs_close
from decodegraph.entrypoints.llm import LLM
from decodegraph.forward_context import BatchDescriptor
from decodegraph.graphs.graph_runner import CaptureClosedError
from decodegraph.graphs.modes import RuntimeMode
from decodegraph.layers.linear import ReplicatedLinear
from decodegraph.sampling_params import SamplingParams
from tests.utils.checkpoints import make_checkpoint
from tests.utils.requests import greedy

GRAPH_MODES = ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
ALL_MODES = ["NONE", *GRAPH_MODES]
SIZES = [1, 4, 16]  # few sizes keep start-up short; the dispatcher tests cover more
# 3 and 7 pad; 25 is above the largest size: the dynamic decode graph's, else eager.
BATCH_SIZES = [1, 3, 7, 16, 25]
MODELS = ["stories", "llama-gqa", "qwen3"]
NUM_LAYERS = {"stories": 5, "llama-gqa": 2, "qwen3": 2}
VOCAB = {"stories": 512, "llama-gqa": 128, "qwen3": 128}

# Engine settings: "standard" runs whole prompts; "tight" forces chunked prefill (steps of
# at most 16 tokens, so mixed batches fit the capture sizes) and preemption (a tiny cache).
CONFIGS: dict[str, dict[str, object]] = {
    "standard": {"max_model_len": 128, "max_num_seqs": 32},
    "tight": {
        "max_model_len": 96,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 16,
        "num_gpu_blocks_override": 12,
    },
    # 15 decodes fill all but one token of the budget: a long prompt is fed one token per
    # step, so uniform one-token batches hold a row that does not sample.
    "one-token-chunks": {"max_model_len": 128, "max_num_seqs": 16, "max_num_batched_tokens": 16},
    # Multi-step scheduling: a pure-decode batch runs up to 5 steps back to back.
    "multi-step": {"max_model_len": 128, "max_num_seqs": 32, "num_scheduler_steps": 5},
}


@pytest.fixture(scope="module")
def model_dirs(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graph_modes_ckpt")
    dirs = {"stories": stories_dir}
    for arch in MODELS[1:]:
        dirs[arch] = make_checkpoint(root, arch)
    return dirs


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path]) -> Iterator[Callable[..., LLM]]:
    """engine(model, mode, config="standard"): built once per module, then reused."""
    cache: dict[tuple[str, str, str], LLM] = {}

    def get(model: str, mode: str, config: str = "standard") -> LLM:
        if (model, mode, config) not in cache:
            cache[(model, mode, config)] = LLM(
                str(model_dirs[model]),
                compilation_config={
                    "cudagraph_mode": mode,
                    "cudagraph_capture_sizes": SIZES,
                    "use_inductor": False,
                    "dynamic_decode_graph": True,
                },
                skip_tokenizer_init=model != "stories",
                **CONFIGS[config],
            )
        return cache[(model, mode, config)]

    yield get
    cache.clear()


def _prompts(model: str, count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    top = VOCAB[model] - 1
    return [
        [1] + [rng.randrange(3, top) for _ in range(rng.randint(*lengths))] for _ in range(count)
    ]


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _ran(llm: LLM, before: dict[tuple[str, str], int]) -> dict[str, int]:
    """Steps run per runtime mode since `before` (a copy of mode_counts)."""
    totals: dict[str, int] = {}
    for (kind, mode), count in llm.llm_engine.runner.graph_runner.mode_counts.items():
        totals[mode] = totals.get(mode, 0) + count - before.get((kind, mode), 0)
    return {m: n for m, n in totals.items() if n}


def _compare(
    engine: Callable[..., LLM],
    model: str,
    mode: str,
    prompts: list[list[int]],
    max_tokens: int,
    config: str = "standard",
) -> dict[str, int]:
    """Greedy ids of `mode` equal NONE's; returns the steps run per runtime mode."""
    expected = _run(engine(model, "NONE", config), prompts, max_tokens)
    llm = engine(model, mode, config)
    before = dict(llm.llm_engine.runner.graph_runner.mode_counts)
    assert _run(llm, prompts, max_tokens) == expected
    return _ran(llm, before)


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_multi_step_batches_replay_graphs_and_give_single_step_ids(
    engine: Callable[..., LLM], mode: str
) -> None:
    """num_scheduler_steps=5: each later step of a batch replays the decode graph over
    the tokens the step before sampled; the ids are those of single-step NONE, and the
    engine schedules fewer times than it decodes."""
    prompts = _prompts("stories", 3, (1, 15), seed=5)
    expected = _run(engine("stories", "NONE"), prompts, 20)
    llm = engine("stories", mode, "multi-step")
    before = dict(llm.llm_engine.runner.graph_runner.mode_counts)
    engine_ = llm.llm_engine
    for i, p in enumerate(prompts):
        engine_.add_request(f"m{i}", {"prompt_token_ids": p}, greedy(20))
    finished, steps = {}, 0
    while engine_.has_unfinished_requests():
        steps += 1
        finished |= {o.request_id: o for o in engine_.step() if o.finished}
    got = [finished[f"m{i}"].outputs[0].token_ids for i in range(len(prompts))]
    assert got == expected
    assert steps <= 1 + -(-19 // 5) + 1  # the prompts, then batches of up to 5 decodes
    assert _ran(llm, before).get("FULL", 0) >= 19


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_greedy_multi_step_batches_sample_with_the_graphs_argmax(
    engine: Callable[..., LLM], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """num_scheduler_steps=5, no multi-step graph: a greedy batch replays the decode
    graph once per step, each step's argmax the next step's token, and never calls the
    sampler (it runs for the prompt step alone); the ids are single-step NONE's. With a
    seeded sampled request beside a greedy one, every step goes through the sampler, with
    the draws of single steps."""
    llm = engine("stories", mode, "multi-step")
    calls: list[int] = []
    sampler = type(llm.llm_engine.runner.step_sampler)
    original = sampler.__call__

    def counted(self, states, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append(len(states))
        return original(self, states, *args)

    prompts = _prompts("stories", 3, (1, 15), seed=6)
    expected = _run(engine("stories", "NONE"), prompts, 20)
    monkeypatch.setattr(sampler, "__call__", counted)
    before = dict(llm.llm_engine.runner.graph_runner.mode_counts)
    assert _run(llm, prompts, 20) == expected
    assert calls == [3]  # the prompt step's three requests
    assert _ran(llm, before).get("FULL", 0) == 19

    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    params = [greedy(20), sampled]
    want = engine("stories", mode).generate(prompts[:2], params, use_tqdm=False)
    calls.clear()
    got = llm.generate(prompts[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(calls) == 20  # the prompt step, then each of the 19 decode steps


def _batch_cases() -> Iterator[object]:
    for model in MODELS:
        for mode in GRAPH_MODES:
            for bs in BATCH_SIZES:
                yield pytest.param(model, mode, bs, id=f"{model}-{mode}-bs{bs}")


@pytest.mark.parametrize("model, mode, bs", list(_batch_cases()))
def test_greedy_ids_equal_mode_none(
    engine: Callable[..., LLM], model: str, mode: str, bs: int
) -> None:
    """Mixed prompt lengths (2 to 16 tokens), batch sizes that need padding."""
    prompts = _prompts(model, bs, (1, 15), seed=bs)
    ran = _compare(engine, model, mode, prompts, max_tokens=8 if model == "stories" else 6)
    if bs > SIZES[-1] and mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        # Its decode steps: the dynamic decode graph (rows 17 to max_num_seqs 32).
        assert ran.get("FULL", 0) > 0, f"no dynamic decode graph step ran: {ran}"
    elif bs > SIZES[-1]:
        assert ran == {"NONE": ran.get("NONE", 0)} and ran, "a batch above 16 must run eager"
    else:
        graph_mode = "PIECEWISE" if mode == "PIECEWISE" else "FULL"
        assert ran.get(graph_mode, 0) > 0, f"no {graph_mode} step ran: {ran}"


def _tight_cases() -> Iterator[object]:
    for model in MODELS[:2]:
        for mode in GRAPH_MODES:
            yield pytest.param(model, mode, id=f"{model}-{mode}")


@pytest.mark.parametrize("model, mode", list(_tight_cases()))
def test_chunked_prefill_matches_mode_none(
    engine: Callable[..., LLM], model: str, mode: str
) -> None:
    """Prompts of 20 to 40 tokens in steps of at most 16: chunks mixed with decodes."""
    prompts = _prompts(model, 2, (20, 40), seed=7)
    ran = _compare(engine, model, mode, prompts, max_tokens=6, config="tight")
    expected_mixed = {"PIECEWISE": "PIECEWISE", "FULL": "FULL"}.get(mode, "")
    if mode == "FULL_AND_PIECEWISE":
        expected_mixed = "PIECEWISE"
    if expected_mixed:
        assert ran.get(expected_mixed, 0) > 0, f"chunks did not run in graphs: {ran}"


@pytest.mark.parametrize("model, mode", list(_tight_cases()))
def test_preemption_matches_mode_none(
    engine: Callable[..., LLM], model: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five requests of up to 55 tokens in an 11-block cache (176 tokens): preemption."""
    preemptions: list[str] = []
    for m in ("NONE", mode):
        scheduler = engine(model, m, "tight").llm_engine.scheduler
        original = scheduler._preempt

        def counting(request: object, original: Callable = original) -> None:
            preemptions.append(request.request_id)
            original(request)

        monkeypatch.setattr(scheduler, "_preempt", counting)
    prompts = _prompts(model, 5, (10, 30), seed=11)
    ran = _compare(engine, model, mode, prompts, max_tokens=24, config="tight")
    assert preemptions, "nothing was preempted: the case does not test preemption"
    assert set(ran) - {"NONE"}, f"no graph ran: {ran}"


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("model", MODELS[:2])
def test_prefix_cache_hits_match_mode_none(
    engine: Callable[..., LLM], model: str, mode: str
) -> None:
    """A shared 40-token prefix; the second round hits the prefix cache."""
    prefix = _prompts(model, 1, (39, 39), seed=3)[0]
    prompts = [prefix + tail[1:] for tail in _prompts(model, 3, (1, 6), seed=4)]
    llm = engine(model, mode)
    hits_before = llm.llm_engine.get_stats().prefix_cache_hits
    for _ in range(2):
        _compare(engine, model, mode, prompts, max_tokens=4)
    assert llm.llm_engine.get_stats().prefix_cache_hits > hits_before


def test_listed_capture_sizes_above_max_num_seqs_serve_mixed_batches(stories_dir: Path) -> None:
    """Mixed keys count tokens (up to max_num_batched_tokens); decode keys count requests."""
    llm = LLM(
        str(stories_dir),
        compilation_config={
            "cudagraph_mode": "FULL_AND_PIECEWISE",
            "cudagraph_capture_sizes": [1, 4, 16, 32],
            "use_inductor": False,
            "dynamic_decode_graph": True,
        },
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=16,
    )
    runner = llm.llm_engine.runner
    assert runner.graph_runner.dispatcher.capture_sizes == [1, 4, 16]
    # Full decode graphs for 1 and 4 requests and the dynamic one for 5 to 8; 6 pieces
    # for each of the three sizes.
    assert runner.graph_runner.stats.dynamic_decode_rows == (5, 8)
    assert runner.graph_runner.stats.num_graphs == 3 + 3 * 6
    prompts = _prompts("stories", 2, (20, 30), seed=9)  # chunks of 16 tokens
    before = dict(runner.graph_runner.mode_counts)
    eager = LLM(str(stories_dir), enforce_eager=True, max_model_len=64, max_num_seqs=8)
    assert _run(llm, prompts, 6) == _run(eager, prompts, 6)
    assert runner.graph_runner.mode_counts[("mixed", "PIECEWISE")] > before.get(
        ("mixed", "PIECEWISE"), 0
    )


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize(
    "settings",
    [{"block_size": 8}, {"block_size": 32, "max_model_len": 100}, {"dtype": "bfloat16"}],
    ids=["block8", "block32", "bf16"],
)
def test_other_block_sizes_and_bfloat16_match_mode_none(
    stories_dir: Path, mode: str, settings: dict[str, object]
) -> None:
    kwargs: dict[str, object] = {"max_model_len": 128, "max_num_seqs": 8, **settings}
    prompts = _prompts("stories", 6, (0, 20), seed=19)
    eager = LLM(str(stories_dir), enforce_eager=True, **kwargs)
    llm = LLM(
        str(stories_dir),
        compilation_config={
            "cudagraph_mode": mode,
            "cudagraph_capture_sizes": [1, 4, 8],
            "use_inductor": False,
        },
        **kwargs,
    )
    assert _run(llm, prompts, 12) == _run(eager, prompts, 12)
    assert llm.llm_engine.runner.graph_runner.mode_counts[("decode", "FULL")] == 11


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_seeded_sampling_and_logprobs_match_mode_none(
    engine: Callable[..., LLM], mode: str
) -> None:
    """Graphs replay the same ops: sampled ids and logprobs match, not only the argmax."""
    prompts = _prompts("stories", 4, (0, 6), seed=13)
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, seed=i, logprobs=2, ignore_eos=True)
        for i in range(len(prompts))
    ]

    def run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [
            (
                o.outputs[0].token_ids,
                [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
            )
            for o in outs
        ]

    expected = run(engine("stories", "NONE"))
    actual = run(engine("stories", mode))
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(actual, expected, strict=True):
        assert ids == ref_ids
        for step, ref_step in zip(logprobs, ref_logprobs, strict=True):
            assert step.keys() == ref_step.keys()
            # Float32 rounding only: eager runs the native RMSNorm operator, a graph
            # the aten ops it decomposes into (fused by Inductor).
            assert list(step.values()) == pytest.approx(list(ref_step.values()), abs=1e-4)


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_aborts_mid_decode_leak_no_kv_blocks(engine: Callable[..., LLM], mode: str) -> None:
    eng = engine("llama-gqa", mode).llm_engine
    free_before = eng.get_stats().num_free_blocks
    for i, prompt in enumerate(_prompts("llama-gqa", 6, (2, 20), seed=17)):
        eng.add_request(f"abort-{mode}-{i}", prompt, greedy(12))
    for _ in range(4):
        eng.step()
    eng.abort_request([f"abort-{mode}-{i}" for i in range(0, 6, 2)])
    while eng.has_unfinished_requests():
        eng.step()
    stats = eng.get_stats()
    assert stats.num_free_blocks == free_before == stats.num_blocks


def test_default_capture_sizes_stop_at_max_num_batched_tokens(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tensor-op path fails cleanly where the unchecked C kernel would crash the run.
    monkeypatch.setattr(CPUAttentionBackend, "use_native_kernel", False)
    llm = LLM(
        str(stories_dir),
        compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "use_inductor": False},
        max_model_len=64,
        max_num_seqs=16,
        max_num_batched_tokens=8,
    )
    assert max(llm.llm_engine.runner.graph_runner.dispatcher.capture_sizes) <= 8


# ---------------------------------------------------------------- counts and capture


def _expected_graphs(mode: str, num_sizes: int, num_layers: int, dynamic: bool = False) -> int:
    """Graphs per capture size times the sizes, and the dynamic decode graph where
    `dynamic` (max_num_seqs above the largest size) and the mode has decode graphs."""
    pieces = num_layers + 1
    per_size = {
        "NONE": 0,
        "PIECEWISE": pieces,
        "FULL": 1,
        "FULL_DECODE_ONLY": 1,
        "FULL_AND_PIECEWISE": 1 + pieces,
    }
    has_dynamic = dynamic and mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
    return per_size[mode] * num_sizes + has_dynamic


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("model", MODELS)
def test_graph_count_on_a_real_engine(engine: Callable[..., LLM], model: str, mode: str) -> None:
    runner = engine(model, mode).llm_engine.runner
    assert runner.graph_runner.mode.name == mode  # the CPU backend supports ALWAYS: no downgrade
    # max_num_seqs 32 is above the largest size, 16: the dynamic decode graph too.
    expected = _expected_graphs(mode, len(SIZES), NUM_LAYERS[model], dynamic=True)
    assert runner.graph_runner.stats.num_graphs == expected
    assert sum(runner.graph_runner.stats.by_mode.values()) == expected


@pytest.mark.parametrize("mode", ALL_MODES)
def test_capture_is_closed_after_start_up(engine: Callable[..., LLM], mode: str) -> None:
    runner = engine("stories", mode).llm_engine.runner
    assert runner.graph_runner.closed
    with pytest.raises(CaptureClosedError):
        runner.graph_runner.capture(
            RuntimeMode.FULL, BatchDescriptor(1, 1, True), runner.model, runner._prepare_dummy
        )


@pytest.mark.parametrize(
    "mode",
    [
        "FULL_DECODE_ONLY",
        "FULL_AND_PIECEWISE",
        "PIECEWISE",
        "FULL",
    ],
)
def test_mode_counts_report_decode_steps_as_decode(engine: Callable[..., LLM], mode: str) -> None:
    llm = engine("stories", mode)
    before = dict(llm.llm_engine.runner.graph_runner.mode_counts)
    _run(llm, _prompts("stories", 1, (3, 3), seed=1), max_tokens=6)
    counts = llm.llm_engine.runner.graph_runner.mode_counts
    decode_mode = "PIECEWISE" if mode == "PIECEWISE" else "FULL"
    assert counts[("decode", decode_mode)] - before.get(("decode", decode_mode), 0) == 5


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_full_decode_graphs_give_greedy_ids_and_the_sampler_runs_otherwise(
    engine: Callable[..., LLM], mode: str
) -> None:
    """A uniform-decode full graph returns its argmax with the logits: all-greedy decode
    steps skip the sampler; a sampled request goes through it. (FULL's one graph per size
    serves mixed batches too and returns hidden states; its steps sample eagerly.)"""
    llm = engine("stories", mode)
    runner = llm.llm_engine.runner
    calls = []
    step_sampler = runner.step_sampler
    sampler = step_sampler.sampler
    step_sampler.sampler = lambda logits, meta: (
        calls.append(logits.shape[0]) or sampler(logits, meta)
    )
    try:
        prompts = _prompts("stories", 3, (4, 9), seed=8)
        assert _run(llm, prompts, 12) == _run(engine("stories", "NONE"), prompts, 12)
        greedy_calls = len(calls)
        seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
        llm.generate(prompts, seeded, use_tqdm=False)
    finally:
        step_sampler.sampler = sampler
    assert greedy_calls <= 1  # the prefill step only
    assert len(calls) - greedy_calls >= 11  # every step of the sampled run


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_full_decode_graph_batches_with_a_row_that_does_not_sample_match_mode_none(
    engine: Callable[..., LLM], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A uniform batch of 16 one-token rows, one of them a prompt chunk short of its end:
    the full decode graph's greedy ids are taken for the sampling rows only."""
    llm = engine("stories", mode, "one-token-chunks")
    runner = llm.llm_engine.runner
    batches: list[tuple[int, int]] = []
    prepare = runner._prepare_inputs

    def spy(so, states, plan):  # noqa: ANN001, ANN202
        batch = prepare(so, states, plan)
        batches.append((batch.num_reqs, len(batch.sample_rows)))
        return batch

    monkeypatch.setattr(runner, "_prepare_inputs", spy)
    prompts = _prompts("stories", 15, (1, 3), seed=5) + _prompts("stories", 1, (30, 30), seed=6)
    expected = _run(engine("stories", "NONE", "one-token-chunks"), prompts, 24)
    assert _run(llm, prompts, 24) == expected
    assert (16, 15) in batches


def test_inductor_compiled_full_decode_graph_matches_mode_none(stories_dir: Path) -> None:
    """The one Inductor test (a compile costs seconds): one capture size, and the dynamic
    decode graph for 2 to 4 requests (compiled once for symbolic rows, then replayed as
    the batch shrinks from 4 to 2)."""
    prompts = _prompts("stories", 1, (5, 5), seed=5)
    llm = LLM(
        str(stories_dir),
        compilation_config={
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": [1],
            "use_inductor": True,
            "dynamic_decode_graph": True,
        },
        max_model_len=64,
        max_num_seqs=4,
    )
    eager = LLM(str(stories_dir), enforce_eager=True, max_model_len=64, max_num_seqs=4)
    assert _run(llm, prompts, 16) == _run(eager, prompts, 16)
    graph_runner = llm.llm_engine.runner.graph_runner
    assert graph_runner.mode_counts[("decode", "FULL")] == 15
    assert graph_runner.stats.dynamic_decode_rows == (2, 4)
    batch = _prompts("stories", 4, (3, 9), seed=6)
    lengths = [greedy(8 + 4 * i) for i in range(4)]
    got = llm.generate(batch, lengths, use_tqdm=False)
    want = eager.generate(batch, lengths, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert graph_runner.graphs[(RuntimeMode.FULL, graph_runner.dynamic_key)].num_replays >= 12
    assert graph_runner.mode_counts[("decode", "NONE")] == 0


def test_inductor_freezing_leaves_kv_caches_and_metadata_live(stories_dir: Path) -> None:
    """Freezing folds a graph's constants: every tensor the attention reads must be a
    graph input (KV caches, slot metadata), or the graph attends over stale copies."""
    prompts = _prompts("stories", 1, (5, 5), seed=7)
    llm = LLM(
        str(stories_dir),
        compilation_config={
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": [1],
            "inductor_compile_config": {"freezing": True},
        },
        max_model_len=64,
        max_num_seqs=4,
    )
    eager = LLM(str(stories_dir), enforce_eager=True, max_model_len=64, max_num_seqs=4)
    assert _run(llm, prompts, 24) == _run(eager, prompts, 24)
    assert llm.llm_engine.runner.graph_runner.mode_counts[("decode", "FULL")] == 23


@pytest.mark.parametrize("use_inductor", [False, True], ids=["trace", "inductor"])
def test_a_bf16_model_takes_the_batch_1_projection_in_a_full_decode_graph(
    cpu_ops: object, tmp_path: Path, use_inductor: bool
) -> None:
    """A bf16 checkpoint whose projections and LM head all hold 64Ki values or more: at
    batch 1 every one of them calls decodegraph's one-row operator (bf16 in and out),
    in the eager steps and inside the FULL_DECODE_ONLY graph, traced or compiled. The
    traced graph runs eager's kernels: the same greedy ids. Inductor's fused kernels
    keep float32 between the ops that eager rounds to bf16 one by one, so the compiled
    graph agrees within vLLM's check_logprobs_close (the issue's bf16 rule): on aarch64
    (torch 2.10, under qemu) its logits moved a bf16 tie between two tokens at the third
    step, where this x86 build gives eager's ids."""
    path = make_checkpoint(
        tmp_path,
        "qwen2",
        dtype=torch.bfloat16,
        hidden_size=256,
        intermediate_size=512,
        vocab_size=512,
    )
    kwargs: dict[str, object] = {"skip_tokenizer_init": True, "max_model_len": 64}
    eager = LLM(str(path), enforce_eager=True, **kwargs)
    model = eager.llm_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, ReplicatedLinear)]
    assert len(linears) == 8 and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert all(m.one_row is not None for m in linears) and model.logits_one_row is not None
    llm = LLM(
        str(path),
        compilation_config={
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": [1],
            "use_inductor": use_inductor,
        },
        **kwargs,
    )
    if not use_inductor:
        (graph,) = llm.llm_engine.runner.graph_runner.graphs.values()
        calls = [n for n in graph.graph_module.graph.nodes if "linear_one_row" in str(n.target)]
        assert len(calls) == len(linears) + 1  # and the LM head
    prompts = _prompts("qwen3", 1, (5, 5), seed=21)  # ids under 128: any vocabulary here
    if not use_inductor:
        assert _run(llm, prompts, 12) == _run(eager, prompts, 12)
    else:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
        outs = [
            [
                (o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in engine.generate(prompts, params, use_tqdm=False)
            ]
            for engine in (eager, llm)
        ]
        check_logprobs_close(outs[0], outs[1], "NONE", "FULL_DECODE_ONLY")
    assert llm.llm_engine.runner.graph_runner.mode_counts[("decode", "FULL")] == 11


# ---------------------------------------------------------------- CLI


def _graphs_cli(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "decodegraph", "--log-level", "WARNING", "graphs", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_graphs_cli_says_the_default_dynamic_decode_graph_is_made_when_first_needed(
    stories_dir: Path,
) -> None:
    from decodegraph.entrypoints.cli import _dynamic_decode_line

    config = {"cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [1, 2]}
    config["use_inductor"] = False
    report = _graphs_cli(
        str(stories_dir), "--max-model-len", "64", "--compilation-config", json.dumps(config)
    )
    assert report["dynamic_decode_rows"] is None  # nothing needed it yet
    assert report["dynamic_decode_planned_rows"] == [3, 256]
    assert report["dynamic_decode_build"] == "not needed yet"
    assert report["num_graphs"] == 2
    assert _dynamic_decode_line(report) == (
        "3 to 256 requests, made in the background when a batch first needs it (not needed yet)"
    )
    assert report["decode_sizes_on_demand"] == {}  # listed sizes: made at start-up


def test_graphs_cli_lists_the_default_sizes_made_on_demand(stories_dir: Path) -> None:
    from decodegraph.entrypoints.cli import _on_demand_line

    config = {"cudagraph_mode": "full_decode_only", "use_inductor": False}
    report = _graphs_cli(
        str(stories_dir), "--max-model-len", "64", "--compilation-config", json.dumps(config)
    )
    assert report["capture_sizes"] == [1, 4, 8] and report["num_graphs"] == 1
    # (JSON keys are strings)
    assert report["decode_sizes_on_demand"] == {"4": "not needed yet", "8": "not needed yet"}
    assert _on_demand_line(report) == (
        "4 (not needed yet), 8 (not needed yet): made in the background when a batch first "
        "needs each"
    )


def test_graphs_cli_prints_mode_sizes_count_time_and_memory(stories_dir: Path) -> None:
    config = {"cudagraph_mode": "full_and_piecewise", "cudagraph_capture_sizes": [1, 2]}
    config["use_inductor"] = False
    config["dynamic_decode_graph"] = True
    report = _graphs_cli(
        str(stories_dir), "--max-model-len", "64", "--compilation-config", json.dumps(config)
    )
    assert report["requested_mode"] == "FULL_AND_PIECEWISE"
    assert report["resolved_mode"] == "FULL_AND_PIECEWISE"
    assert report["capture_sizes"] == [1, 2]
    # The default max_num_seqs is above the largest size: the dynamic decode graph's range.
    assert report["dynamic_decode_rows"] == [3, 256]
    assert report["dynamic_decode_planned_rows"] is None  # made at start-up
    assert report["num_graphs"] == _expected_graphs("FULL_AND_PIECEWISE", 2, 5, dynamic=True)
    assert report["graphs_by_mode"] == {"FULL": 3, "PIECEWISE": 12}
    assert report["kv_cache_blocks"] > 0
    assert report["capture_seconds"] > 0
    assert isinstance(report["capture_memory_bytes"], int) and report["capture_memory_bytes"] >= 0
