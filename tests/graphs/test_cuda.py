"""CUDA graphs (torch.cuda.CUDAGraph): replay equals eager for every mode, graph counts,
padded rows, address checks and capture closing. Skipped where no NVIDIA GPU is present."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from decodegraph.attention.selector import ENV_VAR
from decodegraph.entrypoints.llm import LLM
from decodegraph.forward_context import BatchDescriptor
from decodegraph.graphs.graph_runner import CaptureClosedError
from decodegraph.graphs.modes import RuntimeMode
from decodegraph.graphs.piecewise import PiecewiseGraph
from decodegraph.platforms.base import InputAddressError
from decodegraph.platforms.cuda import CudaGraph
from decodegraph.sampling_params import SamplingParams
from tests.utils.checkpoints import make_checkpoint
from tests.utils.kv import changed_slots
from tests.utils.requests import greedy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU; none is available"
)

SIZES = [1, 2, 4, 8]
NUM_LAYERS = 2  # the random llama-gqa checkpoint
MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
BACKENDS = ["CUDA_TORCH"] + (["TRITON_ATTN"] if importlib.util.find_spec("triton") else [])
# TRITON_ATTN supports every batch in a full graph (ALWAYS); the torch fallback only
# uniform single-token decode, so its FULL becomes FULL_AND_PIECEWISE.
RESOLVED = {
    "TRITON_ATTN": {m: m for m in MODES},
    "CUDA_TORCH": {m: "FULL_AND_PIECEWISE" if m == "FULL" else m for m in MODES},
}
GRAPHS_PER_SIZE = {
    "NONE": 0,
    "FULL": 1,
    "PIECEWISE": NUM_LAYERS + 1,
    "FULL_DECODE_ONLY": 1,
    "FULL_AND_PIECEWISE": 1 + NUM_LAYERS + 1,
}
GREEDY = greedy(12)


@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """Engines built inside take attention backend `name` (the selector's variable)."""
    os.environ[ENV_VAR] = name
    try:
        yield
    finally:
        del os.environ[ENV_VAR]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory, backend: str
) -> Iterator[Callable[[str], LLM]]:
    path = make_checkpoint(tmp_path_factory.mktemp("cuda_ckpt"), "llama-gqa")
    cache: dict[str, LLM] = {}

    def get(mode: str) -> LLM:
        if mode not in cache:
            with attention_backend(backend):
                cache[mode] = _new_llm(path, mode)
            assert cache[mode].llm_engine.runner.attn_backend.name == backend
        return cache[mode]

    yield get
    cache.clear()
    torch.cuda.empty_cache()


def _new_llm(path: Path, mode: str) -> LLM:
    return LLM(
        str(path),
        device="cuda",
        dtype="float32",
        skip_tokenizer_init=True,
        compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": SIZES},
        max_model_len=128,
        max_num_seqs=16,
        # An exact KV size: several engines share the device in this module.
        kv_cache_memory_bytes=16 << 20,
    )


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 127) for _ in range(rng.randint(1, 12))] for _ in range(count)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("bs", [1, 3, 7, 12])
@pytest.mark.parametrize("mode", MODES[1:])
def test_replay_equals_eager(engine: Callable[[str], LLM], mode: str, bs: int) -> None:
    prompts = _prompts(bs, seed=bs)
    llm = engine(mode)
    before = sum(
        n for (_, m), n in llm.llm_engine.runner.graph_runner.mode_counts.items() if m != "NONE"
    )
    assert _greedy(llm, prompts) == _greedy(engine("NONE"), prompts)
    after = sum(
        n for (_, m), n in llm.llm_engine.runner.graph_runner.mode_counts.items() if m != "NONE"
    )
    if bs <= SIZES[-1]:
        assert after > before, "no graph replayed"


@pytest.mark.parametrize("mode", MODES)
def test_resolved_mode_and_graph_count(
    engine: Callable[[str], LLM], backend: str, mode: str
) -> None:
    runner = engine(mode).llm_engine.runner
    resolved = RESOLVED[backend][mode]
    assert runner.graph_runner.mode.name == resolved
    assert runner.graph_runner.stats.num_graphs == GRAPHS_PER_SIZE[resolved] * len(SIZES)
    assert runner.graph_runner.platform.name == "cuda"


def test_piecewise_pieces_bind_no_weight(engine: Callable[[str], LLM]) -> None:
    """Every piece argument is a graph input or an earlier piece's output: no weight is
    ever an argument of (or copied into) a CUDA piece."""
    runner = engine("PIECEWISE").llm_engine.runner
    weights = {t.data_ptr() for t in [*runner.model.parameters(), *runner.model.buffers()]}
    graphs = [g for g in runner.graph_runner.graphs.values() if isinstance(g, PiecewiseGraph)]
    assert len(graphs) == len(SIZES)
    for graph in graphs:
        for name in graph.piece_names:
            piece = getattr(graph.split, name)
            assert not {t.data_ptr() for t in piece.graph.inputs} & weights


def test_graphs_share_one_memory_pool_and_count_their_memory(
    engine: Callable[[str], LLM],
) -> None:
    runner = engine("FULL_DECODE_ONLY").llm_engine.runner
    full = [g for g in runner.graph_runner.graphs.values() if isinstance(g, CudaGraph)]
    assert len(full) == len(SIZES)
    pools = {g._graph.pool() for g in full}
    assert len(pools) == 1
    assert runner.graph_runner.stats.memory_bytes >= 0
    assert runner.graph_runner.stats.seconds > 0


def test_padded_decode_rows_write_only_the_null_block(engine: Callable[[str], LLM]) -> None:
    llm = engine("FULL_DECODE_ONLY")
    eng, runner = llm.llm_engine, llm.llm_engine.runner
    for i, prompt in enumerate(_prompts(3, seed=21)):
        eng.add_request(f"pad{i}", prompt, GREEDY)
    eng.step()  # the prefill (eager)
    before = [t.clone() for pair in runner.attn_backend.kv_caches for t in pair]
    full_before = runner.graph_runner.mode_counts[("decode", "FULL")]
    eng.step()  # decode of 3, padded to 4
    assert runner.graph_runner.mode_counts[("decode", "FULL")] == full_before + 1
    written = sorted(runner.buffers.slot_mapping.np[:3].tolist())
    bs = runner.block_size
    for old, new in zip(before, [t for p in runner.attn_backend.kv_caches for t in p], strict=True):
        slots = changed_slots(old, new)
        assert [s for s in slots if s >= bs] == written
    while eng.has_unfinished_requests():
        eng.step()


def test_a_cuda_graph_replays_its_bound_inputs_and_checks_addresses() -> None:
    x = torch.randn(4, 8, device="cuda")
    w = torch.randn(8, 8, device="cuda")
    stream = torch.cuda.Stream()
    graph = CudaGraph("g", lambda a, b: a @ b, [x, w], torch.cuda.graph_pool_handle(), 1, stream)
    with pytest.raises(InputAddressError):
        graph.check_inputs([x.clone(), w])
    x.copy_(torch.randn(4, 8, device="cuda"))
    torch.testing.assert_close(graph.replay(), x @ w)


def test_a_late_capture_raises(engine: Callable[[str], LLM]) -> None:
    runner = engine("FULL_DECODE_ONLY").llm_engine.runner
    with pytest.raises(CaptureClosedError):
        runner.graph_runner.capture(
            RuntimeMode.FULL, BatchDescriptor(1, 1, True), runner.model, runner._prepare_dummy
        )


def test_a_small_model_starts_with_graphs_and_the_default_memory_budget(
    tmp_path: Path,
) -> None:
    """The graph-pool reserve must not push the budget of a small model below zero."""
    llm = LLM(
        str(make_checkpoint(tmp_path, "llama-gqa")),
        device="cuda",
        skip_tokenizer_init=True,
        compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1]},
        max_model_len=128,
        max_num_seqs=4,
        gpu_memory_utilization=0.5,
    )
    runner = llm.llm_engine.runner
    assert (
        runner.num_blocks_per_group[0] - 1
        >= runner.max_num_reqs * runner.attn_backend.max_blocks_per_seq
    )


def test_warm_up_and_capture_run_on_one_side_stream() -> None:
    streams: list[torch.cuda.Stream] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        streams.append(torch.cuda.current_stream())
        return x * 2

    stream = torch.cuda.Stream()
    CudaGraph("g", fn, [torch.ones(4, device="cuda")], torch.cuda.graph_pool_handle(), 2, stream)
    assert len(streams) == 3  # two warm-ups, then the capture
    assert all(s == stream for s in streams)
    assert stream != torch.cuda.default_stream()


def test_a_long_prompt_chunked_alone_matches_one_step(tmp_path: Path) -> None:
    """Chunks with no decodes beside them sample nothing, so nothing synchronises the
    host between steps: the pinned buffers must wait for their last copy (issue 12)."""
    path = make_checkpoint(tmp_path, "llama-gqa")
    prompt = [1] + [random.Random(5).randrange(3, 127) for _ in range(100)]
    ids = {}
    for tokens in (16, 128):
        llm = LLM(
            str(path),
            device="cuda",
            dtype="float32",
            skip_tokenizer_init=True,
            compilation_config={
                "cudagraph_mode": "FULL_AND_PIECEWISE",
                "cudagraph_capture_sizes": SIZES,
            },
            max_model_len=128,
            max_num_batched_tokens=tokens,
            kv_cache_memory_bytes=16 << 20,
        )
        ids[tokens] = _greedy(llm, [prompt])
        del llm
    assert ids[16] == ids[128]


@pytest.mark.parametrize("mode", MODES[1:])
def test_bf16_graphs_agree_with_eager_within_logprob_tolerance(
    tmp_path_factory: pytest.TempPathFactory, backend: str, mode: str
) -> None:
    from decodegraph.benchmarks.accuracy import check_logprobs_close

    path = make_checkpoint(tmp_path_factory.mktemp("bf16"), "llama-gqa")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    prompts = _prompts(6, seed=9)
    outs = {}
    for m in ("NONE", mode):
        with attention_backend(backend):
            llm = LLM(
                str(path),
                device="cuda",
                dtype="bfloat16",
                skip_tokenizer_init=True,
                compilation_config={"cudagraph_mode": m, "cudagraph_capture_sizes": SIZES},
                max_model_len=128,
                max_num_seqs=16,
                kv_cache_memory_bytes=16 << 20,
            )
        result = llm.generate(prompts, params, use_tqdm=False)
        outs[m] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in result]
        del llm
    check_logprobs_close(outs["NONE"], outs[mode], "NONE", mode)


# Against references we did not write: the output stories260K's authors published, and
# transformers' generate() on the same weights on the same GPU.


@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY", "FULL"])
def test_the_bundled_model_tells_the_published_story(
    stories_dir: Path, backend: str, mode: str
) -> None:
    from tests.conftest import STORIES_GREEDY_TEXT

    with attention_backend(backend):
        llm = LLM(
            str(stories_dir),
            device="cuda",
            dtype="float32",
            compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": SIZES},
            max_model_len=128,
            kv_cache_memory_bytes=16 << 20,
        )
    # The story four times in one batch, beside prompts of other lengths.
    prompts = [[1]] * 4 + _prompts(3, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(61), use_tqdm=False)
    assert [o.outputs[0].text for o in outs[:4]] == [STORIES_GREEDY_TEXT] * 4
    counts = llm.llm_engine.runner.graph_runner.mode_counts
    if mode != "NONE":
        assert any(runtime == "FULL" and n for (_, runtime), n in counts.items()), counts


def test_greedy_ids_and_logprobs_match_transformers_on_the_gpu(
    engine: Callable[[str], LLM], tmp_path_factory: pytest.TempPathFactory
) -> None:
    from transformers import AutoModelForCausalLM

    from tests.models.test_engine_vs_transformers import PROMPTS, hf_generate

    llm = engine("FULL_DECODE_ONLY")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    path = make_checkpoint(tmp_path_factory.mktemp("hf_ref"), "llama-gqa")
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    ref = ref.cuda().eval()
    ref.generation_config.eos_token_id = None
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.device("cuda"):
            want_ids, want_logprobs = hf_generate(ref, prompt, num_tokens=24)
        got = out.outputs[0]
        assert got.token_ids == want_ids, f"prompt of {len(prompt)} tokens"
        for step, tok in enumerate(want_ids):
            assert got.logprobs[step][tok].logprob == pytest.approx(
                want_logprobs[step, tok].item(), abs=1e-3
            )
