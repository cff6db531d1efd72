"""Multi-step graphs (docs/design.md §3): with num_scheduler_steps > 1 and
`compilation_config.multi_step_graphs`, a greedy multi-step batch is one replay of a
graph that runs all its steps, each step's argmax the next one's tokens. Its ids are
single-step NONE's; batches it cannot run (sampling, logprobs, a shorter batch) run a
graph per step with the same ids as before."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from decodegraph.config import CompilationConfig
from decodegraph.entrypoints.llm import LLM
from decodegraph.graphs.graph_runner import GraphRunner
from decodegraph.graphs.modes import RuntimeMode
from decodegraph.sampling_params import SamplingParams
from tests.utils.checkpoints import make_checkpoint
from tests.utils.requests import greedy

STEPS = 4
SIZES = [1, 4]
VOCAB = {"stories": 512, "llama-gqa": 128, "gemma2": 128}


@pytest.fixture(scope="module")
def model_dirs(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multi_step_ckpt")
    return {
        "stories": stories_dir,
        **{a: make_checkpoint(root, a) for a in ("llama-gqa", "gemma2")},
    }


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path]) -> Iterator[Callable[..., LLM]]:
    """engine(model, mode, steps, graphs=True, inductor=False): built once per module."""
    cache: dict[tuple, LLM] = {}

    def get(model: str, mode: str, steps: int, graphs: bool = True, inductor: bool = False) -> LLM:
        key = (model, mode, steps, graphs, inductor)
        if key not in cache:
            cache[key] = LLM(
                str(model_dirs[model]),
                max_model_len=128,
                max_num_seqs=4,
                num_scheduler_steps=steps,
                skip_tokenizer_init=model != "stories",
                compilation_config={
                    "cudagraph_mode": mode,
                    "cudagraph_capture_sizes": SIZES if not inductor else [1],
                    "use_inductor": inductor,
                    "multi_step_graphs": graphs,
                },
            )
        return cache[key]

    yield get
    cache.clear()


def _prompts(model: str, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    top = VOCAB[model] - 1
    return [[1] + [rng.randrange(3, top) for _ in range(rng.randint(1, 15))] for _ in range(count)]


def _ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _multi_step_replays(llm: LLM) -> dict[int, int]:
    """Replays of each multi-step graph so far, by its size."""
    graphs = llm.llm_engine.runner.graph_runner.graphs
    return {
        key.num_tokens: graph.num_replays
        for (mode, key), graph in graphs.items()
        if mode is RuntimeMode.FULL and key.num_steps > 1
    }


@pytest.mark.parametrize(
    "model, mode",
    [
        ("stories", "FULL_DECODE_ONLY"),
        ("llama-gqa", "FULL_DECODE_ONLY"),
        ("gemma2", "FULL_DECODE_ONLY"),
        # FULL serves single steps with its mixed graphs; the multi-step ones are uniform.
        ("stories", "FULL"),
    ],
)
def test_greedy_multi_step_batches_are_one_replay_each_with_single_step_ids(
    engine: Callable[..., LLM], model: str, mode: str
) -> None:
    """Three requests (padded to the 4-row graph: a row that must stay empty) and one
    alone, 30 tokens each from prompts of 2-16 tokens: every batch of 4 steps after
    the prompts is one replay, across block boundaries (block size 16), in one attention
    group (stories, llama GQA) and in two (Gemma 2: sliding window and soft-capping)."""
    llm = engine(model, mode, STEPS)
    graphs = llm.llm_engine.runner.graph_runner
    assert graphs.graph_num_steps == STEPS
    assert _multi_step_replays(llm) == {1: 0, 4: 0}
    reference = engine(model, "NONE", 1)
    for prompts in (_prompts(model, 3, seed=1), _prompts(model, 1, seed=2)):
        assert _ids(llm, prompts, greedy(30)) == _ids(reference, prompts, greedy(30))
    replays = _multi_step_replays(llm)
    # 29 decode tokens after the prompt step: 7 batches of 4, then one step alone.
    assert replays == {1: 7, 4: 7}


def test_a_stop_inside_a_multi_step_graphs_batch_ends_the_request_there(
    engine: Callable[..., LLM],
) -> None:
    """A stop token and EOS sampled inside a batch: the request ends on that token, as
    with single steps (the graph's later tokens are dropped)."""
    llm = engine("stories", "FULL_DECODE_ONLY", STEPS)
    reference = engine("stories", "NONE", 1)
    full = _ids(reference, [[1]], greedy(60))[0]
    stop = SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[full[9]])
    before = _multi_step_replays(llm)[1]
    expected = _ids(reference, [[1]], stop)
    assert expected[0][-1] == full[9] and len(expected[0]) <= 10
    assert _ids(llm, [[1]], stop) == expected
    # Without ignore_eos: the published story ends with EOS inside a batch.
    eos = greedy(100, ignore_eos=False)
    assert _ids(llm, [[1]], eos) == _ids(reference, [[1]], eos)
    assert _multi_step_replays(llm)[1] > before


def test_batches_that_sample_or_want_logprobs_run_a_graph_per_step(
    engine: Callable[..., LLM],
) -> None:
    """A seeded sampled request, a greedy one with logprobs, and the two beside a
    greedy one: none replays the multi-step graph, and each gets what a graph per step
    gives it (the same seeded draws, the same logprobs)."""
    llm = engine("stories", "FULL_DECODE_ONLY", STEPS)
    per_step = engine("stories", "FULL_DECODE_ONLY", STEPS, graphs=False)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, logprobs=2, max_tokens=20, ignore_eos=True)
    penalised = SamplingParams(
        temperature=0.0, repetition_penalty=1.3, max_tokens=20, ignore_eos=True
    )
    before = _multi_step_replays(llm)
    for params in (sampled, with_logprobs, penalised, [greedy(20), sampled]):
        prompts = [[1, 30], [1, 31]] if isinstance(params, list) else [[1, 30]]
        got = llm.generate(prompts, params, use_tqdm=False)
        want = per_step.generate(prompts, params, use_tqdm=False)
        for a, b in zip(got, want, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert _multi_step_replays(llm) == before


def test_min_tokens_keeps_batches_per_step_until_it_is_reached(
    engine: Callable[..., LLM],
) -> None:
    """While a request's min_tokens masks EOS its batches run a graph per step; once it
    is reached, the multi-step graph: the same ids as single steps, stopping at EOS."""
    llm = engine("stories", "FULL_DECODE_ONLY", STEPS)
    reference = engine("stories", "NONE", 1)
    params = SamplingParams(temperature=0.0, min_tokens=70, max_tokens=120)
    before = _multi_step_replays(llm)[1]
    assert _ids(llm, [[1]], params) == _ids(reference, [[1]], params)
    assert _multi_step_replays(llm)[1] > before


def test_an_inductor_compiled_multi_step_graph_gives_single_step_ids(
    engine: Callable[..., LLM],
) -> None:
    """The compiled graph (Inductor lowers the slot and length arithmetic between steps):
    2 steps per graph, batch 1."""
    llm = engine("stories", "FULL_DECODE_ONLY", 2, inductor=True)
    expected = _ids(engine("stories", "NONE", 1), [[1, 30]], greedy(24))
    assert _ids(llm, [[1, 30]], greedy(24)) == expected
    assert _multi_step_replays(llm) == {1: 11}


def test_without_full_decode_graphs_or_the_option_a_batch_runs_a_graph_per_step(
    engine: Callable[..., LLM], caplog: pytest.LogCaptureFixture
) -> None:
    """multi_step_graphs is off by default; PIECEWISE has no full decode graph to extend
    (said once, with the reason)."""
    assert (
        engine(
            "stories", "FULL_DECODE_ONLY", STEPS, graphs=False
        ).llm_engine.runner.graph_runner.graph_num_steps
        == 1
    )
    caplog.set_level(logging.INFO, logger="decodegraph.graphs.graph_runner")
    llm = engine("stories", "PIECEWISE", STEPS)
    assert llm.llm_engine.runner.graph_runner.graph_num_steps == 1
    assert _multi_step_replays(llm) == {}
    assert any(
        "runs a graph per step: graph mode PIECEWISE has no full decode graphs" in r.message
        for r in caplog.records
    )
    prompts = _prompts("stories", 2, seed=3)
    assert _ids(llm, prompts, greedy(12)) == _ids(engine("stories", "NONE", 1), prompts, greedy(12))


def test_tensor_parallelism_or_a_backend_that_cannot_advance_runs_a_graph_per_step(
    engine: Callable[..., LLM], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resolution of a rank of two (rank 0 samples and broadcasts there), and of an
    attention group whose backend reads a host value it would not see advance: no
    multi-step graph, and the reason said."""
    runner = engine("stories", "FULL_DECODE_ONLY", STEPS).llm_engine.runner
    graphs = runner.graph_runner

    def resolved(world_size: int) -> int:
        other = GraphRunner(
            graphs.config,
            graphs.platform,
            graphs.buffers,
            graphs.attn_groups,
            runner._eager_context,
            world_size=world_size,
        )
        other.resolve()
        return other.graph_num_steps

    caplog.set_level(logging.INFO, logger="decodegraph.graphs.graph_runner")
    assert resolved(1) == STEPS
    assert resolved(2) == 1
    (group,) = graphs.attn_groups
    monkeypatch.setattr(
        type(graphs.attn_groups[group]), "supports_multi_step_graphs", lambda _: False
    )
    assert resolved(1) == 1
    messages = [r.message for r in caplog.records]
    assert any("tensor parallelism samples on rank 0" in m for m in messages)
    assert any(f"attention group(s) {group} cannot advance inside a graph" in m for m in messages)


def test_multi_step_graphs_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="^compilation_config.multi_step_graphs:"):
        CompilationConfig(multi_step_graphs="yes")  # type: ignore[arg-type]
