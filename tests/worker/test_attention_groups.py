"""Models with sliding-window layers, end to end: Mistral and Qwen2 windows, Gemma 2 and
Gemma 3 (sliding and full layers in one model, two attention groups).

Against transformers on random checkpoints the tests save, with prompts longer than
the window and generation far past it; batched, chunked, preempted and prefix-hit runs
against a solo run; every graph mode against NONE; the sliding group's memory over a
long generation; and attention groups found by name, never by order.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import decodegraph.worker.attention_groups as attention_groups
from decodegraph import LLM
from decodegraph.core.kv_cache_spec import SlidingWindowSpec
from tests.utils.checkpoints import make_checkpoint
from tests.utils.requests import greedy

WINDOWED = ["mistral-window", "qwen2-window", "gemma2", "gemma3"]
GRAPH_MODES = ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
NUM_TOKENS = 56


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {arch: make_checkpoint(root, arch) for arch in WINDOWED}


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 128) for _ in range(length - 1)]


def _llm(path: Path, mode: str = "NONE", **kwargs: object) -> LLM:
    settings: dict = {"max_model_len": 128, "max_num_seqs": 8, **kwargs}
    return LLM(
        str(path),
        skip_tokenizer_init=True,
        compilation_config={
            "cudagraph_mode": mode,
            "cudagraph_capture_sizes": [1, 2, 4, 8],
            "use_inductor": False,
        },
        **settings,
    )


def _ids(llm: LLM, prompts: list[list[int]], num_tokens: int = NUM_TOKENS) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(num_tokens), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", WINDOWED)
def test_greedy_ids_past_the_window_match_transformers(
    arch: str, checkpoints: dict[str, Path]
) -> None:
    llm = _llm(checkpoints[arch])
    windows = [
        g.spec.sliding_window
        for g in llm.llm_engine.runner.kv_cache_groups
        if isinstance(g.spec, SlidingWindowSpec)
    ]
    assert windows and max(windows) < 20  # the prompt alone is longer than the window
    prompt = _prompt(20, seed=1)
    ref = AutoModelForCausalLM.from_pretrained(
        checkpoints[arch], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref.generation_config.eos_token_id = None  # all NUM_TOKENS steps, EOS included
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert _ids(llm, [prompt]) == [want]


@pytest.mark.parametrize("arch", WINDOWED)
def test_batched_chunked_and_preempted_runs_match_a_solo_run(
    arch: str, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [_prompt(n, seed=n) for n in (3, 14, 25, 31, 22)]
    solo = _llm(checkpoints[arch], max_num_seqs=1, max_model_len=80)
    want = [_ids(solo, [p], 40)[0] for p in prompts]
    # Batched, with chunked prefill (8 tokens a step, across the window's edge) and a
    # cache so small (5 blocks of 16 tokens per group) that requests are preempted.
    tight = _llm(
        checkpoints[arch], max_model_len=80, max_num_batched_tokens=8, num_gpu_blocks_override=6
    )
    sched = tight.llm_engine.scheduler
    preempted: list[str] = []
    preempt = sched._preempt
    monkeypatch.setattr(sched, "_preempt", lambda r: preempted.append(r.request_id) or preempt(r))
    assert _ids(tight, prompts, 40) == want
    assert preempted
    for manager in sched.kv_cache_manager.managers:
        assert manager.pool.num_free_blocks == manager.pool.num_blocks - 1  # no leaks


@pytest.mark.parametrize("arch", ["gemma2", "mistral-window"])
def test_a_prefix_hit_gives_the_solo_runs_ids(arch: str, checkpoints: dict[str, Path]) -> None:
    """The second prompt shares 32 tokens (two blocks) with the first: both groups hit,
    the sliding group only where its window's blocks are still cached."""
    first = _prompt(40, seed=5)
    second = first[:32] + [9, 9, 9]
    want = _ids(_llm(checkpoints[arch], enable_prefix_caching=False), [second])
    llm = _llm(checkpoints[arch])
    _ids(llm, [first])
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    assert _ids(llm, [second]) == want
    assert llm.llm_engine.get_stats().prefix_cache_hits - hits == 32


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("arch", WINDOWED)
def test_every_graph_mode_matches_mode_none(
    arch: str, mode: str, checkpoints: dict[str, Path]
) -> None:
    prompts = [_prompt(n, seed=3 * n) for n in (2, 13, 27)]
    want = _ids(_llm(checkpoints[arch]), prompts)
    llm = _llm(checkpoints[arch], mode)
    assert _ids(llm, prompts) == want
    counts = llm.llm_engine.runner.graph_runner.mode_counts
    assert sum(n for (_, m), n in counts.items() if m != "NONE") > 0


def test_attention_groups_are_found_by_name_not_by_order(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same model with its groups listed the other way round gives the same ids, in
    a full decode graph whose params are refreshed per group."""
    prompts = [_prompt(n, seed=n) for n in (5, 24)]
    want = _ids(_llm(checkpoints["gemma2"], "FULL_DECODE_ONLY"), prompts)
    build = attention_groups.kv_cache_groups
    monkeypatch.setattr(
        attention_groups, "kv_cache_groups", lambda *a, **k: list(reversed(build(*a, **k)))
    )
    llm = _llm(checkpoints["gemma2"], "FULL_DECODE_ONLY")
    names = [g.name for g in llm.llm_engine.runner.kv_cache_groups]
    assert names == ["full_attention", "sliding_attention"]  # gemma2 starts with sliding
    assert _ids(llm, prompts) == want


@pytest.mark.parametrize("group", ["full_attention", "sliding_attention"])
def test_a_group_left_unrefreshed_gives_wrong_output(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    """Each group's graph params must be refreshed before a replay: skip one group's
    (as zipping groups with a shorter list by order would) and its layers attend with
    the capture's dummy lengths."""
    prompts = [_prompt(24, seed=2)]
    want = _ids(_llm(checkpoints["gemma2"]), prompts)
    llm = _llm(checkpoints["gemma2"], "FULL_DECODE_ONLY")
    graph_runner = llm.llm_engine.runner.graph_runner
    monkeypatch.setattr(
        graph_runner.attn_groups[group], "update_graph_params", lambda params_id, md: None
    )
    assert _ids(llm, prompts) != want
    assert graph_runner.mode_counts[("decode", "FULL")] > 0


def test_an_inductor_compiled_decode_graph_of_gemma2(checkpoints: dict[str, Path]) -> None:
    """Soft-capping and two attention groups inside one compiled graph (one size)."""
    prompts = [_prompt(18, seed=4)]
    want = _ids(_llm(checkpoints["gemma2"]), prompts, 24)
    llm = LLM(
        str(checkpoints["gemma2"]),
        skip_tokenizer_init=True,
        max_model_len=128,
        compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1]},
    )
    assert _ids(llm, prompts, 24) == want


def test_the_sliding_group_holds_its_window_over_a_4k_token_generation(tmp_path: Path) -> None:
    """Mistral with a 12-token window decodes 4,000 tokens: its one (sliding) group never
    holds more than the window's blocks, the block it writes and one just filled."""
    path = make_checkpoint(tmp_path, "mistral-window", max_position_embeddings=4200)
    llm = _llm(path, max_model_len=4200, max_num_seqs=1)
    engine = llm.llm_engine
    (manager,) = engine.scheduler.kv_cache_manager.managers
    spec = manager.spec
    assert isinstance(spec, SlidingWindowSpec)
    engine.add_request("long", {"prompt_token_ids": _prompt(40, seed=9)}, greedy(4000))
    most = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        most = max(most, manager.pool.num_blocks - 1 - manager.pool.num_free_blocks)
    assert steps >= 4000
    assert most <= spec.window_blocks + 2
    assert manager.pool.num_free_blocks == manager.pool.num_blocks - 1
