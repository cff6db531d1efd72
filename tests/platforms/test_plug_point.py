"""The platform plug point: a platform defined outside decodegraph/platforms (the
test-only `StaticGraphPlatform`, whose graphs behave like device graphs) runs the engine
end to end in every graph mode, with no change anywhere else."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from decodegraph.entrypoints.llm import LLM
from tests.conftest import STORIES_GREEDY_TEXT
from tests.utils.platforms import StaticGraphPlatform, registered_platform
from tests.utils.requests import greedy

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
SIZES = [1, 2, 4]
LAYERS = 5  # stories260K
GRAPHS_PER_SIZE = {
    "NONE": 0,
    "PIECEWISE": LAYERS + 1,
    "FULL": 1,
    "FULL_DECODE_ONLY": 1,
    "FULL_AND_PIECEWISE": 1 + LAYERS + 1,
}
PROMPTS = [[1], [1, 50, 60], [1, 70, 80, 90, 100]]


@pytest.fixture(scope="module")
def device() -> Iterator[str]:
    with registered_platform(StaticGraphPlatform) as name:
        yield name


def _llm(stories_dir: Path, device: str, mode: str) -> LLM:
    return LLM(
        str(stories_dir),
        device=device,
        compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": SIZES},
        max_model_len=128,
        max_num_seqs=4,
    )


@pytest.fixture(scope="module")
def eager_ids(stories_dir: Path) -> list[list[int]]:
    llm = LLM(str(stories_dir), enforce_eager=True, max_model_len=128, max_num_seqs=4)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(32), use_tqdm=False)]


@pytest.mark.parametrize("mode", MODES)
def test_a_test_only_platform_runs_the_engine_in_every_mode(
    stories_dir: Path, device: str, eager_ids: list[list[int]], mode: str
) -> None:
    llm = _llm(stories_dir, device, mode)
    engine = llm.llm_engine
    assert isinstance(engine.platform, StaticGraphPlatform)
    graph_runner = engine.runner.graph_runner
    assert graph_runner.mode.name == mode
    assert graph_runner.stats.num_graphs == GRAPHS_PER_SIZE[mode] * len(SIZES)
    outs = llm.generate(PROMPTS, greedy(32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == eager_ids
    graph_steps = sum(n for (_, m), n in graph_runner.mode_counts.items() if m != "NONE")
    assert (graph_steps > 0) == (mode != "NONE")


def test_the_published_story_comes_out_of_a_full_decode_graph_there(
    stories_dir: Path, device: str
) -> None:
    llm = _llm(stories_dir, device, "FULL_DECODE_ONLY")
    out = llm.generate([[1]], greedy(64, ignore_eos=False), use_tqdm=False)[0].outputs[0]
    assert STORIES_GREEDY_TEXT.startswith(out.text) or out.text.startswith(STORIES_GREEDY_TEXT)
    assert llm.llm_engine.runner.graph_runner.mode_counts[("decode", "FULL")] > 0
