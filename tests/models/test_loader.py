"""Finding checkpoints, loading safetensors (single, sharded, broken) and dummy weights."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file

from decodegraph.config import ModelConfig, parse_dtype
from decodegraph.layers.linear import ReplicatedLinear
from decodegraph.models.loader import (
    get_config_dtype,
    get_model,
    list_safetensors_files,
    load_hf_config,
    resolve_model_path,
)
from tests.utils.checkpoints import make_checkpoint


def build(model: str, load_format: str = "auto", dtype: torch.dtype = torch.float32):
    mc = ModelConfig(model=model, load_format=load_format)
    return get_model(mc, load_hf_config(mc), dtype, "cpu")


def test_local_directory_resolves_to_itself(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path), None) == tmp_path


def test_preset_resolves_to_no_directory() -> None:
    assert resolve_model_path("preset:llama-tiny", None) is None


def test_offline_hub_id_error_says_offline_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same switch HF_HUB_OFFLINE=1 sets at import; an empty cache holds no snapshot.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError) as info:
        resolve_model_path("someorg/no-such-model", None)
    message = str(info.value)
    assert "'someorg/no-such-model'" in message
    assert "HF_HUB_OFFLINE" in message and "local directory" in message


def test_malformed_model_name_is_neither_directory_nor_hub_id() -> None:
    with pytest.raises(ValueError, match="neither a local directory nor a valid Hugging Face"):
        resolve_model_path("./missing dir//x", None)


def test_sharded_listing_follows_the_index(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "llama-gqa", max_shard_size="40KB")
    files = list_safetensors_files(path)
    assert len(files) > 2 and all(f.suffix == ".safetensors" for f in files)


def test_missing_weight_is_a_clear_error(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "llama-gqa")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.self_attn\.qkv_proj"):
        build(str(path))


def test_unexpected_weight_is_a_clear_error(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "llama-gqa")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.extra\.weight'"):
        build(str(path))


def test_wrong_shape_names_the_weight(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "llama-gqa")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight 'model\.layers\.0\.mlp\.up_proj\.weight'.*shape"):
        build(str(path))


def test_tied_checkpoint_loads_without_lm_head_and_shares_the_embedding(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "llama-tied")
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = build(str(path))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_checkpoint_without_lm_head_is_missing_it(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "llama-gqa")
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights: lm_head.weight"):
        build(str(path))


def test_dtype_auto_reads_the_checkpoint_config(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16)
    hf_config = load_hf_config(ModelConfig(model=str(path)))
    assert parse_dtype("auto", get_config_dtype(hf_config)) == torch.bfloat16
    float_path = make_checkpoint(tmp_path / "f", "qwen3")
    float_config = load_hf_config(ModelConfig(model=str(float_path)))
    assert parse_dtype("auto", get_config_dtype(float_config)) == torch.float32


def test_dummy_weights_need_no_files_and_are_seeded(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "qwen2")
    (path / "model.safetensors").unlink()
    a, b = build(str(path), "dummy"), build(str(path), "dummy")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert bool((pa == 1).all()), name
        elif name.endswith(".bias"):
            assert bool((pa == 0).all()), name
        else:
            assert 0.01 < float(pa.std()) < 0.03, name


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_loaded_linear_layers_are_processed_after_loading(tmp_path: Path, load_format: str) -> None:
    model = build(str(make_checkpoint(tmp_path, "qwen2")), load_format)
    layers = [m for m in model.modules() if isinstance(m, ReplicatedLinear)]
    assert len(layers) == 4 * model.config.num_hidden_layers
    for layer in layers:
        assert layer.weight_t is not None and torch.equal(layer.weight_t, layer.weight.t())


def test_preset_builds_with_dummy_weights_in_the_requested_dtype() -> None:
    model = build("preset:qwen3-tiny", "dummy", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.tensor([256, 104, 105])
    logits = model.compute_logits(model(ids, torch.arange(3)))
    assert logits.shape == (3, 258) and bool(torch.isfinite(logits).all())


def test_preset_refuses_load_format_safetensors() -> None:
    with pytest.raises(ValueError, match="preset with no weights"):
        build("preset:llama-tiny", "safetensors")
