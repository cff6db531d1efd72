"""The Llama family against transformers on the same saved weights (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import AutoModelForCausalLM

from decodegraph.attention.layer import Attention
from decodegraph.config import ModelConfig
from decodegraph.models.llama import LlamaForCausalLM, layer_sliding_window
from decodegraph.models.loader import get_model, load_hf_config
from tests.utils.checkpoints import CHECKPOINTS, VOCAB_SIZE, make_checkpoint, make_hf_config

PROMPT = [1, 17, 42, 99, 5, 63, 120, 7, 33, 88, 11]


def load_ours(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    mc = ModelConfig(model=str(path))
    return get_model(mc, load_hf_config(mc), dtype, "cpu")


def load_hf(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@torch.no_grad()
def our_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids, dtype=torch.int64)
    return model.compute_logits(model(t, torch.arange(len(ids), dtype=torch.int64)))


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root, arch) for arch in CHECKPOINTS}


@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_prefill_logits_match_transformers(arch: str, checkpoints: dict[str, Path]) -> None:
    ours, ref = load_ours(checkpoints[arch]), load_hf(checkpoints[arch])
    got, want = our_logits(ours, PROMPT), hf_logits(ref, PROMPT)
    assert got.dtype == torch.float32 and got.shape == (len(PROMPT), VOCAB_SIZE)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_greedy_ids_match_transformers_generate(arch: str, checkpoints: dict[str, Path]) -> None:
    ours, ref = load_ours(checkpoints[arch]), load_hf(checkpoints[arch])
    ref.generation_config.eos_token_id = None  # run all 40 steps on both sides
    want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, pad_token_id=0)[
        0, len(PROMPT) :
    ].tolist()
    ids = list(PROMPT)
    for _ in range(40):  # full re-forward each step: no KV cache on our side
        ids.append(int(our_logits(ours, ids)[-1].argmax()))
    assert ids[len(PROMPT) :] == want


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen3"])
def test_sharded_checkpoint_loads_same_logits(arch: str, tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, arch, max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    assert (path / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(
        our_logits(load_ours(path), PROMPT), hf_logits(load_hf(path), PROMPT), atol=1e-4, rtol=1e-4
    )


def test_rope_rows_follow_positions_not_row_order(
    checkpoints: dict[str, Path],
) -> None:
    # In a batch, rows are requests at unrelated positions (decode of several sequences).
    model = load_ours(checkpoints["llama-rope-llama3"])
    rope = model.model.rotary_emb
    pos = torch.tensor([200, 3, 77])
    cos, sin = rope.get_cos_sin(pos)
    full_cos, full_sin = rope.get_cos_sin(torch.arange(256))
    torch.testing.assert_close(cos, full_cos[pos])
    torch.testing.assert_close(sin, full_sin[pos])


def test_stories260k_prefill_logits_match_transformers(stories_dir: Path) -> None:
    ours, ref = load_ours(stories_dir), load_hf(stories_dir)
    ids = [1, 403, 407, 261, 378, 17, 300, 511]  # BOS and ordinary ids (vocab 512)
    torch.testing.assert_close(our_logits(ours, ids), hf_logits(ref, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_stays_close_to_float32(
    dtype: torch.dtype, checkpoints: dict[str, Path]
) -> None:
    path = checkpoints["qwen3"]
    half = load_ours(path, dtype)
    assert {p.dtype for p in half.parameters()} == {dtype}
    assert half.model.rotary_emb.cos_sin_cache.dtype == dtype
    got = our_logits(half, PROMPT)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, our_logits(load_ours(path), PROMPT), atol=0.1, rtol=0.05)


def test_forward_traces_with_make_fx_and_replays_exactly(checkpoints: dict[str, Path]) -> None:
    # docs/design.md §4: no host sync, shapes from T only, so the forward is a replayable graph.
    model = load_ours(checkpoints["qwen3"])
    ids = torch.tensor(PROMPT[:5])
    with torch.no_grad():
        graph = make_fx(lambda i, p: model(i, p))(ids, torch.arange(5))
    other_ids, other_pos = torch.tensor([9, 8, 7, 6, 5]), torch.tensor([0, 1, 2, 3, 4])
    with torch.no_grad():
        torch.testing.assert_close(graph(other_ids, other_pos), model(other_ids, other_pos))


def test_each_layer_gets_the_window_transformers_applies_to_it() -> None:
    mistral = make_hf_config("mistral", sliding_window=64)
    assert [layer_sliding_window(mistral, i) for i in range(2)] == [64, 64]
    qwen2 = make_hf_config("qwen2-window")  # use_sliding_window, max_window_layers=2
    assert [layer_sliding_window(qwen2, i) for i in range(4)] == [None, None, 10, 10]
    plain = make_hf_config("qwen2")  # no use_sliding_window: no window anywhere
    assert [layer_sliding_window(plain, i) for i in range(2)] == [None, None]
    model = LlamaForCausalLM(mistral)
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    assert windows == [64, 64]
