"""Tensor parallelism end to end on CPU (gloo), docs/design.md §8: greedy ids at
tensor_parallel_size 2 equal tensor_parallel_size 1's and transformers' on stories260K
and on a checkpoint of every architecture, in modes NONE, FULL_DECODE_ONLY and
FULL_AND_PIECEWISE, with batched prompts, chunked prefill, preemption and prefix-cache
hits; each rank captures its own graphs, with the all-reduce inside them.

Each TP engine starts two worker processes, so the cases are few and each covers a lot:
one run of every engine goes through chunked prefill (16-token steps), preemption (a
tiny cache) and, run again, prefix-cache hits."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from decodegraph.engine.async_llm import AsyncLLM
from decodegraph.engine.core import EngineDeadError
from decodegraph.entrypoints.llm import LLM
from decodegraph.sampling_params import RequestOutputKind, SamplingParams
from decodegraph.structured_output.params import StructuredOutputsParams
from tests.conftest import STORIES_GREEDY_TEXT
from tests.utils.checkpoints import VOCAB_SIZE, make_checkpoint
from tests.utils.processes import free_port_pair, gone
from tests.utils.requests import greedy
from tests.utils.server import make_engine, start_server, wait_for_health

# One checkpoint per architecture (and Llama with one KV head: two ranks replicate it).
ARCHS = ["llama-gqa", "llama-mqa", "mistral-window", "qwen2-window", "qwen3", "gemma2", "gemma3"]
NUM_TOKENS = 12
# Chunked prefill (16-token steps, so that mixed batches fit the capture sizes) and
# preemption (12 blocks of 16 tokens for 6 requests of up to 50 tokens).
TIGHT = {
    "max_model_len": 96,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 16,
    "num_gpu_blocks_override": 12,
}
SIZES = [1, 2, 4, 8, 16]
# Every layer of mistral-window has a 12-token window: its requests hold few blocks, so
# it needs a smaller cache to preempt.
BLOCKS = {"mistral-window": 6}


@pytest.fixture(scope="module")
def model_dirs(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_ckpt")
    dirs = {"stories": stories_dir}
    for arch in ARCHS:
        if arch == "llama-mqa":
            dirs[arch] = make_checkpoint(root / "mqa", "llama-gqa", num_key_value_heads=1)
        else:
            dirs[arch] = make_checkpoint(root, arch)
    return dirs


def prompts_for(model: str, seed: int = 0) -> list[list[int]]:
    """Six prompts of 5 to 34 tokens; the last three share a 20-token prefix with the
    first (a prefix-cache hit when run again, or after the first finished)."""
    vocab = 512 if model == "stories" else VOCAB_SIZE
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(4, 33))] for _ in range(3)]
    shared = [1] + [rng.randrange(3, vocab) for _ in range(31)]
    prompts += [shared[:20] + [rng.randrange(3, vocab) for _ in range(n)] for n in (2, 8, 14)]
    prompts[0] = shared
    return prompts


def tp_llm(path: Path, mode: str, tp: int, **kwargs: object) -> LLM:
    blocks = BLOCKS.get(path.name, TIGHT["num_gpu_blocks_override"])
    return LLM(
        str(path),
        tensor_parallel_size=tp,
        skip_tokenizer_init=path.name != "stories260K",
        compilation_config={
            "cudagraph_mode": mode,
            "cudagraph_capture_sizes": SIZES,
            "use_inductor": kwargs.pop("use_inductor", False),
        },
        **{**TIGHT, "num_gpu_blocks_override": blocks, **kwargs},
    )


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(NUM_TOKENS), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


def transformers_ids(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    ids = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0
            )
            ids.append(out[0, len(p) :].tolist())
    return ids


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> Iterator[dict]:
    """model -> greedy ids at tensor_parallel_size 1 (mode NONE, same settings)."""
    cache: dict[str, list[list[int]]] = {}

    def get(model: str) -> list[list[int]]:
        if model not in cache:
            llm = tp_llm(model_dirs[model], "NONE", 1)
            cache[model] = generate(llm, prompts_for(model))
            llm.llm_engine.shutdown()
        return cache[model]

    yield get


def check_tp_run(llm: LLM, model: str, reference: object, mode: str) -> None:
    """Two runs of the prompts (the second hits the prefix cache) equal TP 1's ids; the
    run preempted, chunked, and ran graphs in `mode` on every rank."""
    prompts = prompts_for(model)
    engine = llm.llm_engine
    want = reference(model)
    assert generate(llm, prompts) == want
    assert generate(llm, prompts) == want
    stats = engine.get_stats()
    assert engine.scheduler.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    mixed = {"NONE": "NONE", "FULL_DECODE_ONLY": "NONE", "FULL_AND_PIECEWISE": "PIECEWISE"}
    assert stats.mode_counts.get(("mixed", mixed[mode]), 0) > 0
    if mode != "NONE":
        assert stats.mode_counts.get(("decode", "FULL"), 0) > 0
    assert (
        len(engine.engine_core.ranks) == 2 and len({r.pid for r in engine.engine_core.ranks}) == 2
    )


@pytest.mark.parametrize("model", ["stories", *ARCHS])
def test_two_ranks_give_the_ids_of_one_and_of_transformers_with_piecewise_and_full_graphs(
    model: str, model_dirs: dict[str, Path], reference: object
) -> None:
    path = model_dirs[model]
    llm = tp_llm(path, "FULL_AND_PIECEWISE", 2)
    try:
        check_tp_run(llm, model, reference, "FULL_AND_PIECEWISE")
        # Each rank captured the decode graphs and every size's pieces.
        graphs = llm.llm_engine.engine_core.capture_stats.by_mode
        decode_sizes = [s for s in SIZES if s <= TIGHT["max_num_seqs"]]
        assert graphs["FULL"] == len(decode_sizes) and graphs["PIECEWISE"] > len(SIZES)
    finally:
        llm.llm_engine.shutdown()
    if model != "stories":
        assert reference(model) == transformers_ids(path, prompts_for(model))


@pytest.mark.parametrize("model", ["stories", "llama-gqa"])
@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY"])
def test_two_ranks_give_the_ids_of_one_eager_and_with_full_decode_graphs(
    model: str, mode: str, model_dirs: dict[str, Path], reference: object
) -> None:
    # Inductor compiles the decode graphs (and the all-reduce in them) on stories.
    llm = tp_llm(model_dirs[model], mode, 2, use_inductor=model == "stories")
    try:
        check_tp_run(llm, model, reference, mode)
        if model == "stories":
            out = llm.generate("", greedy(61), use_tqdm=False)[0].outputs[0]
            assert out.text == STORIES_GREEDY_TEXT
    finally:
        llm.llm_engine.shutdown()


def test_two_ranks_run_multi_step_batches_with_the_ids_of_one(
    model_dirs: dict[str, Path], reference: object
) -> None:
    """num_scheduler_steps=4: every rank replays each later step of a batch over the
    tokens rank 0 sampled and broadcast in the step before."""
    llm = tp_llm(model_dirs["stories"], "FULL_DECODE_ONLY", 2, num_scheduler_steps=4)
    try:
        check_tp_run(llm, "stories", reference, "FULL_DECODE_ONLY")
        engine = llm.llm_engine
        engine.add_request("alone", {"prompt_token_ids": [1, 5]}, greedy(NUM_TOKENS))
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            engine.step()
        assert steps == 1 + -(-(NUM_TOKENS - 1) // 4)  # the prompt, then batches of 4
    finally:
        llm.llm_engine.shutdown()


def test_a_rank_whose_graphs_differ_from_the_plan_fails_the_step_and_hangs_nobody(
    stories_dir: Path,
) -> None:
    """The driver plans each step once; a rank that would run it otherwise (here: eager
    where the others replay the size-4 graph) refuses it, and the engine fails at once
    instead of waiting in a collective."""
    llm = LLM(
        str(stories_dir),
        tensor_parallel_size=2,
        worker_cls="tests.utils.workers.DivergingWorker",
        max_model_len=64,
        compilation_config={"cudagraph_capture_sizes": [1, 4], "use_inductor": False},
    )
    try:
        # A batch of 1 replays size 1 on both ranks.
        assert generate(llm, [[1, 5]])[0]
        with pytest.raises(
            Exception, match=r"rank 1: the driver planned FULL \(4, 4, True\) for 3 requests"
        ):
            generate(llm, [[1, 5], [1, 6], [1, 7]])
        with pytest.raises(Exception, match="failed earlier"):
            generate(llm, [[1, 5]])
    finally:
        llm.llm_engine.shutdown()


def test_a_killed_worker_fails_the_requests_in_flight_within_90_s_and_leaves_no_process(
    stories_dir: Path,
) -> None:
    """SIGKILL one rank mid-run: the request in flight fails with an error naming the
    dead worker, the engine reports itself unhealthy (what /health answers), and after
    shutdown no worker process is left."""
    engine = LLM(
        str(stories_dir), tensor_parallel_size=2, max_model_len=512, enforce_eager=True
    ).llm_engine
    async_llm = AsyncLLM(engine)
    victim = engine.engine_core.ranks[1].pid
    params = greedy(500)
    params.output_kind = RequestOutputKind.DELTA

    async def run() -> float:
        killed_at = None
        with pytest.raises(EngineDeadError, match="died"):
            async for _ in async_llm.generate({"prompt_token_ids": [1]}, params, "r"):
                if killed_at is None:
                    os.kill(victim, signal.SIGKILL)
                    killed_at = time.monotonic()
        return time.monotonic() - killed_at

    try:
        assert asyncio.run(asyncio.wait_for(run(), 120)) < 90
        assert async_llm.errored
    finally:
        async_llm.shutdown()
    assert gone([r.pid for r in engine.engine_core.ranks], within_s=10)


def test_the_ray_backend_gives_the_ids_of_one_rank(
    model_dirs: dict[str, Path], reference: object
) -> None:
    """The same workers as Ray actors, on a local cluster the executor starts."""
    llm = tp_llm(model_dirs["llama-gqa"], "FULL_DECODE_ONLY", 2, distributed_executor_backend="ray")
    try:
        check_tp_run(llm, "llama-gqa", reference, "FULL_DECODE_ONLY")
    finally:
        llm.llm_engine.shutdown()


def test_two_nodes_meeting_on_loopback_give_the_ids_of_one_node(
    model_dirs: dict[str, Path], reference: object
) -> None:
    """Node 1 is `decodegraph serve --headless` with the same engine flags; node 0 runs
    the engine and rank 0; they meet at master_addr:master_port."""
    path, port = model_dirs["llama-gqa"], free_port_pair()
    flags = {
        "--max-model-len": TIGHT["max_model_len"],
        "--max-num-seqs": TIGHT["max_num_seqs"],
        "--max-num-batched-tokens": TIGHT["max_num_batched_tokens"],
        "--num-gpu-blocks-override": TIGHT["num_gpu_blocks_override"],
        "-O": json.dumps(
            {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": SIZES,
             "use_inductor": False}
        ),
    }  # fmt: skip
    node1 = subprocess.Popen(
        [sys.executable, "-m", "decodegraph", "serve", str(path), "--headless",
         "--skip-tokenizer-init", "-tp", "2", "--nnodes", "2", "--node-rank", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(port),
         *[str(x) for kv in flags.items() for x in kv]],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip
    try:
        llm = tp_llm(
            path,
            "FULL_DECODE_ONLY",
            2,
            nnodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=port,
        )
        try:
            check_tp_run(llm, "llama-gqa", reference, "FULL_DECODE_ONLY")
        finally:
            llm.llm_engine.shutdown()
        assert node1.wait(timeout=60) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_the_server_answers_unhealthy_once_a_worker_died_and_refuses_requests(
    stories_dir: Path,
) -> None:
    """A real server on loopback over a TP 2 engine: a worker killed while idle turns
    /health to 503 (the engine's watchdog, not a failed step), and a request then gets
    an error answer, not a hang."""
    server = start_server(make_engine(stories_dir, tensor_parallel_size=2, max_model_len=128))
    engine = server.async_llm.engine
    try:
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        os.kill(engine.engine_core.ranks[0].pid, signal.SIGKILL)
        wait_for_health(server.base_url, 503, 90, "/health still 200 after a worker died")
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": server.model_name, "prompt": "Once", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code >= 500 and "error" in reply.json()
    finally:
        server.stop()
    assert gone([r.pid for r in engine.engine_core.ranks], within_s=10)


def test_two_ranks_sample_logprobs_and_grammars_as_one(stories_dir: Path) -> None:
    """Rank 0 samples for both ranks: seeded random sampling, logprobs, prompt logprobs
    and a grammar give what tensor_parallel_size 1 gives (every rank feeds rank 0's
    tokens to its next step)."""
    prompts = ["Once upon a time", "The little dog", "Lily and Tom"]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2),
        SamplingParams(
            temperature=0.8,
            seed=3,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(choice=["happy", "sad", "big red ball"]),
        ),
    ]

    def run(tp: int) -> list:
        llm = LLM(str(stories_dir), tensor_parallel_size=tp, max_model_len=128, enforce_eager=True)
        try:
            return llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()

    one, two = run(1), run(2)
    for a, b in zip(one, two, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
    assert two[2].outputs[0].text in ("happy", "sad", "big red ball")
    for lp_a, lp_b in zip(one[0].outputs[0].logprobs, two[0].outputs[0].logprobs, strict=True):
        assert lp_b.keys() == lp_a.keys()
        for t in lp_a:
            assert lp_b[t].logprob == pytest.approx(lp_a[t].logprob, abs=1e-4)
    assert len(two[1].prompt_logprobs) == len(one[1].prompt_logprobs) > 1
    for pa, pb in zip(one[1].prompt_logprobs[1:], two[1].prompt_logprobs[1:], strict=True):
        assert pb.keys() == pa.keys()
