"""The model runner on stories260K, driven by hand-made scheduler data (plain ids, token
ids, block ids and sampling params: never an engine `Request`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from decodegraph.core.sched_output import NewRequestData, SchedulerOutput
from decodegraph.engine.arg_utils import EngineArgs
from decodegraph.entrypoints.llm import LLM
from decodegraph.platforms import get_platform
from decodegraph.worker.input_batch import InputBatch
from decodegraph.worker.model_runner import ModelRunner
from tests.utils.requests import greedy

BLOCK_SIZE = 16


def make_runner(stories_dir: Path, mode: str = "NONE") -> ModelRunner:
    config = EngineArgs(
        model=str(stories_dir),
        max_model_len=64,
        max_num_seqs=4,
        block_size=BLOCK_SIZE,
        compilation_config={
            "cudagraph_mode": mode,
            "cudagraph_capture_sizes": [1, 2, 4],
            "use_inductor": False,
        },
    ).create_engine_config()
    runner = ModelRunner(config, get_platform("cpu"), config.model_config.hf_config)
    runner.load_model(config.model_config.model_path)
    runner.profile_run()
    runner.initialize_kv_cache(num_blocks=1 + 4 * 4)
    runner.resolve_graph_mode()
    runner.capture_graphs()
    return runner


def run_by_hand(runner: ModelRunner, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """A scheduler in miniature: every request's whole prompt in the first step, then one
    token each; four blocks per request, handed out up front."""
    ids = [str(i) for i in range(len(prompts))]
    news = [
        NewRequestData(rid, p, greedy(max_tokens), None, ([1 + 4 * i + j for j in range(4)],), 0)
        for i, (rid, p) in enumerate(zip(ids, prompts, strict=True))
    ]
    counts = [len(p) for p in prompts]
    so = SchedulerOutput(ids, counts, sum(counts), scheduled_new_reqs=news)
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_tokens):
        out = runner.execute_model(so)
        assert out.req_ids == ids
        for i, tok in enumerate(out.sampled_token_ids):
            outputs[i].append(tok)
        # Decodes within the blocks handed out: no deltas at all.
        so = SchedulerOutput(ids, [1] * len(ids), len(ids))
    return outputs


PROMPTS = [[1], [1, 50, 60], [1, 70, 80, 90]]


@pytest.fixture(scope="module")
def llm_ids(stories_dir: Path) -> list[list[int]]:
    llm = LLM(str(stories_dir), enforce_eager=True, max_model_len=64, max_num_seqs=4)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(20), use_tqdm=False)]


@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_a_runner_fed_plain_scheduler_data_decodes_as_the_engine_does(
    stories_dir: Path, llm_ids: list[list[int]], mode: str
) -> None:
    runner = make_runner(stories_dir, mode)
    assert run_by_hand(runner, PROMPTS, 20) == llm_ids
    # The runner appended what it sampled: its states hold prompt plus outputs.
    for i, prompt in enumerate(PROMPTS):
        assert runner.requests[str(i)].all_token_ids == prompt + llm_ids[i]
    counts = runner.graph_runner.mode_counts
    assert counts[("mixed", "NONE")] == 1  # 8 prompt tokens: above the largest size
    assert counts[("decode", "NONE" if mode == "NONE" else "FULL")] == 19


def test_finished_requests_leave_the_runner(stories_dir: Path) -> None:
    runner = make_runner(stories_dir)
    run_by_hand(runner, PROMPTS[:2], 3)
    assert len(runner.requests) == 2
    runner.execute_model(SchedulerOutput(["1"], [1], 1, finished_req_ids={"0"}))
    assert "0" not in runner.requests and "1" in runner.requests


def test_sampling_statics_are_cached_per_runner(stories_dir: Path) -> None:
    """The batch statics cache is the runner's: reused across its steps while the same
    requests sit in the same rows, never shared with another runner."""
    first, second = make_runner(stories_dir), make_runner(stories_dir)
    assert first.step_sampler.statics is not second.step_sampler.statics
    run_by_hand(first, PROMPTS, 2)
    cached = first.step_sampler.statics._last
    assert cached is not None and [s.req_id for s in cached[0]] == ["0", "1", "2"]
    assert second.step_sampler.statics._last is None


class _PeakMeasuringCpuPlatform(type(get_platform("cpu"))):
    """The CPU platform as a device platform profiles: the largest batch."""

    def profile_num_tokens(self, max_num_tokens: int) -> int:
        return max_num_tokens


@pytest.mark.parametrize("measures_peak", [False, True])
def test_the_profiling_forward_is_the_largest_batch_only_where_a_peak_is_measured(
    stories_dir: Path, measures_peak: bool
) -> None:
    config = EngineArgs(
        model=str(stories_dir), max_model_len=64, max_num_batched_tokens=512, enforce_eager=True
    ).create_engine_config()
    platform = _PeakMeasuringCpuPlatform() if measures_peak else get_platform("cpu")
    runner = ModelRunner(config, platform, config.model_config.hf_config)
    runner.load_model(config.model_config.model_path)
    seen: list[int] = []
    runner.model.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    runner.profile_run()
    assert seen == [512 if measures_peak else platform.profile_num_tokens(512)]
    assert seen[0] == 512 or seen[0] < 64


@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY"])
def test_decode_steps_written_in_place_decode_as_steps_written_afresh(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Continuous batching over blocks of 4 tokens: requests finish at different steps
    and waiting ones join, and decoding requests cross a block every fourth step. The
    steps that go on from the last one in place (InputBatch.next_decode, from 8 rows on)
    give the same greedy ids as every step written afresh, and most steps are such."""
    prompts = [[1, 20 + 7 * i] for i in range(12)]
    params = [greedy(16 + 3 * i) for i in range(12)]

    def generate() -> list[list[int]]:
        llm = LLM(
            str(stories_dir),
            max_model_len=64,
            max_num_seqs=10,
            block_size=4,
            compilation_config={
                "cudagraph_mode": mode,
                "cudagraph_capture_sizes": [1, 2, 4, 8, 16],
                "use_inductor": False,
            },
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    in_place: list[int] = []
    next_decode = InputBatch.next_decode

    def counted(self: InputBatch, *args: object) -> InputBatch:
        in_place.append(self.num_reqs)
        return next_decode(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(InputBatch, "next_decode", counted)
    ids = generate()
    assert [len(i) for i in ids] == [16 + 3 * i for i in range(12)]
    # 10 requests at first, the other two joining as the first two finish, one finishing
    # every third step, and fewer than 8 for the last 20 steps or so: most steps in
    # between go on in place, all from 8 rows on.
    assert len(in_place) >= 15 and min(in_place) >= 8
    monkeypatch.setattr(InputBatch, "continues_in_place", lambda *_: False)
    in_place.clear()
    assert generate() == ids
    assert not in_place
