"""Tensor parallelism on CUDA (NCCL, the all-reduces captured into each rank's CUDA
graphs): two GPUs give the greedy ids of one. Skipped without two NVIDIA GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decodegraph.entrypoints.llm import LLM
from tests.utils.checkpoints import make_checkpoint
from tests.utils.requests import greedy

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="tensor parallelism on CUDA needs two NVIDIA GPUs; "
    f"{torch.cuda.device_count()} available",
)

PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "FULL"])
def test_two_gpus_give_the_ids_of_one_in_every_graph_mode(mode: str, tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "llama-gqa")
    ids = {}
    for tp in (1, 2):
        llm = LLM(
            str(path),
            tensor_parallel_size=tp,
            skip_tokenizer_init=True,
            max_model_len=128,
            max_num_seqs=8,
            dtype="float32",
            compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4]},
        )
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(16))
            ids[tp] = [o.outputs[0].token_ids for o in outs]
            if mode != "NONE":
                assert llm.llm_engine.get_stats().graph_runs.get("FULL", 0) > 0
        finally:
            llm.llm_engine.shutdown()
    assert ids[2] == ids[1]
