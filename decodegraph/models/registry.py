"""Architecture name (config.json `architectures[0]`) to model class."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from decodegraph.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from decodegraph.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

_MODELS: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_supported_archs() -> list[str]:
    """Architecture names decodegraph can run."""
    return list(_MODELS)


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The model class for `hf_config.architectures[0]`; ValueError listing the supported
    architectures otherwise."""
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else None
    if arch not in _MODELS:
        raise ValueError(
            f"model architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(_MODELS)}"
        )
    return _MODELS[arch]
