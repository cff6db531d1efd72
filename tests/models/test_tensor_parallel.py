"""Models at tensor parallel size 2 on two gloo ranks: the same logits as at size 1 and as
transformers, on stories260K and on every random architecture checkpoint, each rank
reading only its shard of the checkpoint.

One spawned run (module fixture) loads every checkpoint on both ranks and records what
the tests below check; spawning torch processes costs seconds, so it happens once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import AutoModelForCausalLM

from decodegraph.attention.layer import Attention
from decodegraph.config import ModelConfig
from decodegraph.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group
from decodegraph.models.loader import (
    _default_dtype,
    get_model,
    iterate_safetensors,
    load_hf_config,
    process_weights_after_loading,
)
from decodegraph.models.registry import get_model_class
from decodegraph.models.weights import CheckpointSlice
from tests.utils.checkpoints import CHECKPOINTS, make_checkpoint, make_hf_config
from tests.utils.distributed import run_on_ranks

PROMPT = [1, 17, 42, 99, 5, 63, 120, 7, 33, 88, 11, 126]
STORIES_PROMPT = [1, 403, 407, 261, 378, 17, 300, 511]
# Beyond CHECKPOINTS: one KV head on two ranks (replicated), and a vocabulary that two
# ranks split only after padding (tied, so the embedding and the LM head both pad).
EXTRA = {
    "llama-one-kv-head": ("llama-gqa", {"num_key_value_heads": 1}),
    "llama-tied-odd-vocab": ("llama-tied", {"vocab_size": 127}),
}
TRACED = "qwen3"
RUNNER_MODES = [
    "NONE",
    "FULL_AND_PIECEWISE",
]  # the checkpoint whose TP forward is also traced with make_fx


class _CountingSlice:
    """A safetensors slice that counts the elements read through it."""

    def __init__(self, source: Any, name: str, counts: dict[str, int]) -> None:
        self.source, self.name, self.counts = source, name, counts

    def get_shape(self) -> list[int]:
        return self.source.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        out = self.source[index]
        self.counts[self.name] = self.counts.get(self.name, 0) + out.numel()
        return out


def _load_counting_reads(path: Path) -> tuple[torch.nn.Module, dict[str, tuple[int, int]]]:
    """The model at `path` loaded as get_model does, every read counted:
    {checkpoint name: (elements read, elements in the tensor)}."""
    hf_config = load_hf_config(ModelConfig(model=str(path)))
    with _default_dtype(torch.float32):
        model = get_model_class(hf_config)(hf_config).eval()
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}

    def weights():
        for name, lazy in iterate_safetensors(path):
            sizes[name] = lazy.numel()
            yield name, CheckpointSlice.of(_CountingSlice(lazy.source, name, counts))

    loaded = model.load_weights(weights())
    assert loaded == {name for name, _ in model.named_parameters()}
    process_weights_after_loading(model)
    return model, {name: (counts.get(name, 0), n) for name, n in sizes.items()}


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids)
    return model.compute_logits(model(t, torch.arange(len(ids))))


def _forward_and_logits(model: torch.nn.Module) -> Any:
    return lambda ids, pos: model.compute_logits(model(ids, pos))


@torch.no_grad()
def _rank_run(paths: dict[str, str], stories: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rank": get_tensor_model_parallel_rank(),
        "shm": get_tp_group().shm is not None,
    }
    for name, path in paths.items():
        model, reads = _load_counting_reads(Path(path))
        attn = next(m for m in model.modules() if isinstance(m, Attention))
        out[name] = {
            "logits": _logits(model, PROMPT),
            "reads": reads,
            "heads": (attn.num_heads, attn.num_kv_heads),
        }
        if name == TRACED:
            ids, pos = torch.tensor(PROMPT[:5]), torch.arange(5)
            gm = make_fx(_forward_and_logits(model))(ids, pos)
            targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            out["traced_ops"] = targets
            other = torch.tensor([9, 8, 7, 6, 5])
            out["traced_replay"] = (gm(other, pos), _logits(model, other.tolist()))
    mc = ModelConfig(model=stories)
    model = get_model(mc, load_hf_config(mc), torch.float32, "cpu")  # the engine's path
    out["stories260K"] = {"logits": _logits(model, STORIES_PROMPT)}
    bad = make_hf_config("llama-gqa", intermediate_size=95)
    try:
        get_model_class(bad)(bad)
    except ValueError as e:
        out["bad_intermediate_size"] = str(e)
    # The model runner at TP 2 (its KV cache holds this rank's heads), eager and with
    # graphs that contain the collectives, driven by hand-made scheduler data.
    from tests.worker.test_model_runner import PROMPTS, make_runner, run_by_hand

    for mode in RUNNER_MODES:
        runner = make_runner(Path(stories), mode)
        out[f"runner_{mode}"] = {
            "kv_heads": runner.num_kv_heads,
            "bytes_per_block": runner.kv_cache_bytes_per_block(),
            "ids": run_by_hand(runner, PROMPTS, 8),
        }
    dummy = ModelConfig(model=stories, load_format="dummy")
    model = get_model(dummy, load_hf_config(dummy), torch.float32, "cpu")
    out["dummy_logits"] = _logits(model, STORIES_PROMPT)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    paths = {arch: make_checkpoint(root, arch) for arch in CHECKPOINTS}
    for name, (arch, overrides) in EXTRA.items():
        paths[name] = make_checkpoint(root / name, arch, **overrides)
    return paths


@pytest.fixture(scope="module")
def ranks(checkpoints: dict[str, Path], stories_dir: Path) -> list[dict[str, Any]]:
    paths = {name: str(p) for name, p in checkpoints.items()}
    return run_on_ranks(_rank_run, 2, paths, str(stories_dir), timeout_s=300)


def _tp1_and_hf(path: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    mc = ModelConfig(model=str(path))
    ours = get_model(mc, load_hf_config(mc), torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    return _logits(ours, ids), want


def test_every_checkpoint_tp2_logits_equal_tp1_and_transformers(
    ranks: list[dict[str, Any]], checkpoints: dict[str, Path]
) -> None:
    for name, path in checkpoints.items():
        tp1, hf = _tp1_and_hf(path, PROMPT)
        for r in ranks:  # every rank ends with the whole logits
            got = r[name]["logits"]
            assert got.dtype == torch.float32 and got.shape == tp1.shape, name
            torch.testing.assert_close(got, tp1, atol=1e-5, rtol=1e-5, msg=name)
            torch.testing.assert_close(got, hf, atol=1e-4, rtol=1e-4, msg=name)


def test_stories260k_tp2_logits_equal_tp1_and_transformers(
    ranks: list[dict[str, Any]], stories_dir: Path
) -> None:
    tp1, hf = _tp1_and_hf(stories_dir, STORIES_PROMPT)
    for r in ranks:
        torch.testing.assert_close(r["stories260K"]["logits"], tp1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["stories260K"]["logits"], hf, atol=1e-4, rtol=1e-4)


def test_each_rank_attends_with_its_heads_and_replicates_a_lone_kv_head(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert r["llama-gqa"]["heads"] == (2, 1)  # 4 heads, 2 KV heads: split
        assert r["llama-mha"]["heads"] == (2, 2)
        assert r["llama-one-kv-head"]["heads"] == (2, 1)  # 1 KV head: on both ranks


def test_no_rank_reads_a_whole_tensor_it_holds_only_part_of(
    ranks: list[dict[str, Any]],
) -> None:
    for name in ["llama-gqa", "llama-bias", "gemma3", "qwen3", "llama-one-kv-head"]:
        replicated_kv = name == "llama-one-kv-head"
        for r in ranks:
            reads = r[name]["reads"]
            for tensor, (read, full) in reads.items():
                whole = "norm" in tensor or (
                    tensor.endswith("o_proj.bias") or tensor.endswith("down_proj.bias")
                )
                whole = whole or (replicated_kv and ("k_proj" in tensor or "v_proj" in tensor))
                want = full if whole else full // 2
                assert read == want, f"{name} rank {r['rank']}: {tensor} read {read} of {full}"
            total_read = sum(read for read, _ in reads.values())
            total = sum(full for _, full in reads.values())
            assert total_read < 0.6 * total


def test_a_tp_forward_traces_with_one_all_reduce_per_block_and_replays(
    ranks: list[dict[str, Any]],
) -> None:
    layers = CHECKPOINTS[TRACED][2].get("num_hidden_layers", 2)
    for r in ranks:
        ops = r["traced_ops"]
        # The embedding's, then o_proj's and down_proj's in each layer; the logits' gather.
        # Through shared memory where the ranks share a host (here, unless the CPU
        # operators are not built), else gloo's functional collectives.
        if r["shm"]:
            assert ops.count("decodegraph_cpu.shm_all_reduce.default") == 1 + 2 * layers
            assert ops.count("decodegraph_cpu.shm_all_gather.default") == 1
            assert not any("c10d" in op for op in ops)
        else:
            assert ops.count("_c10d_functional.all_reduce.default") == 1 + 2 * layers
            assert ops.count("_c10d_functional.all_gather_into_tensor.default") == 1
            assert ops.count("_c10d_functional.wait_tensor.default") == 2 + 2 * layers
        replayed, eager = r["traced_replay"]
        torch.testing.assert_close(replayed, eager)


def test_dummy_weights_at_tp2_are_slices_of_the_tp1_dummy_weights(
    ranks: list[dict[str, Any]], stories_dir: Path
) -> None:
    mc = ModelConfig(model=str(stories_dir), load_format="dummy")
    tp1 = _logits(get_model(mc, load_hf_config(mc), torch.float32, "cpu"), STORIES_PROMPT)
    assert tp1.std() > 0.01  # far from the tolerance below: the comparison means something
    for r in ranks:
        torch.testing.assert_close(r["dummy_logits"], tp1, atol=1e-5, rtol=1e-5)


def test_an_intermediate_size_two_ranks_cannot_split_names_tensor_parallel_size(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert r.get("bad_intermediate_size") == (
            "tensor_parallel_size (2) must divide intermediate_size (95)"
        )


def test_the_model_runner_at_tp2_caches_its_kv_heads_and_decodes_as_tp1(
    ranks: list[dict[str, Any]], stories_dir: Path
) -> None:
    from tests.worker.test_model_runner import PROMPTS, make_runner, run_by_hand

    tp1 = make_runner(stories_dir, "NONE")
    want = run_by_hand(tp1, PROMPTS, 8)
    for r in ranks:
        for mode in RUNNER_MODES:
            got = r[f"runner_{mode}"]
            assert got["kv_heads"] == tp1.num_kv_heads // 2 == 2, mode
            assert got["bytes_per_block"] * 2 == tp1.kv_cache_bytes_per_block(), mode
            assert got["ids"] == want, mode
