"""Architecture lookup."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from decodegraph.models.llama import Qwen2ForCausalLM, Qwen3ForCausalLM
from decodegraph.models.registry import get_model_class, get_supported_archs
from tests.utils.checkpoints import make_hf_config


@pytest.mark.parametrize(
    ("arch", "cls"), [("qwen2", Qwen2ForCausalLM), ("qwen3", Qwen3ForCausalLM)]
)
def test_architecture_name_selects_its_class(arch: str, cls: type) -> None:
    assert get_model_class(make_hf_config(arch)) is cls


def test_unsupported_architecture_error_lists_the_supported_ones() -> None:
    config = LlamaConfig(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as info:
        get_model_class(config)
    message = str(info.value)
    assert "'GPT2LMHeadModel' is not supported" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message
    assert set(get_supported_archs()) >= {"LlamaForCausalLM", "Qwen3ForCausalLM"}


def test_config_without_architectures_is_unsupported() -> None:
    with pytest.raises(ValueError, match="None is not supported"):
        get_model_class(LlamaConfig())
