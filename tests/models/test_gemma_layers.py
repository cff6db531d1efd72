"""Gemma's per-layer-type setup: which layers slide, and which rope each layer uses."""

from __future__ import annotations

import torch

from decodegraph.attention.layer import Attention
from decodegraph.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from tests.utils.checkpoints import make_hf_config


def _windows(model: Gemma2ForCausalLM) -> list[int | None]:
    return [m.sliding_window for m in model.modules() if isinstance(m, Attention)]


def test_gemma2_without_layer_types_windows_only_its_even_layers() -> None:
    config = make_hf_config("gemma2")  # sliding_window 9, four layers
    del config.layer_types  # as in configs written before transformers had the field
    assert getattr(config, "layer_types", None) is None
    assert _windows(Gemma2ForCausalLM(config)) == [9, None, 9, None]


def test_gemma2_with_layer_types_windows_the_layers_it_marks_sliding() -> None:
    config = make_hf_config("gemma2")
    config.layer_types = ["full_attention", "sliding_attention"] * 2
    assert _windows(Gemma2ForCausalLM(config)) == [None, 9, None, 9]


def test_layers_with_the_same_rope_settings_share_one_rope() -> None:
    gemma2 = Gemma2ForCausalLM(make_hf_config("gemma2")).model  # one setting for all layers
    assert len(gemma2.rotary_emb) == 1 and gemma2.layer_rope == [0, 0, 0, 0]
    gemma3 = Gemma3ForCausalLM(make_hf_config("gemma3")).model  # a base per layer type
    assert [layer.layer_type[0] for layer in gemma3.layers] == list("ssfssf")
    assert gemma3.layer_rope == [0, 0, 1, 0, 0, 1]
    sliding, full = (rope.cos_sin_cache for rope in gemma3.rotary_emb)
    assert not torch.equal(sliding, full)
