"""Small random Hugging Face checkpoints, saved as real safetensors directories.

`make_checkpoint(tmp_path, "llama-gqa")` builds the model with transformers (fixed seed,
float32, tiny sizes) and `save_pretrained`s it, so tests load exactly what a user would
and compare against transformers on the same weights. Tests pass token ids directly;
no tokenizer is saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 128

_BASE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# What Gemma 2 and 3 need beyond _BASE (tied embeddings, as their checkpoints are).
_GEMMA: dict[str, Any] = {
    "head_dim": 16,
    "num_hidden_layers": 4,
    "query_pre_attn_scalar": 16,
    "sliding_window": 9,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}

# name -> (config class, architecture, settings over _BASE)
CHECKPOINTS: dict[str, tuple[type[PretrainedConfig], str, dict[str, Any]]] = {
    "llama-gqa": (LlamaConfig, "LlamaForCausalLM", {}),
    "llama-mha": (LlamaConfig, "LlamaForCausalLM", {"num_key_value_heads": 4}),
    "llama-tied": (LlamaConfig, "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama-bias": (LlamaConfig, "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-llama3": (
        LlamaConfig,
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-rope-linear": (
        LlamaConfig,
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    ),
    "llama-rope-yarn": (
        LlamaConfig,
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "mistral": (MistralConfig, "MistralForCausalLM", {"sliding_window": None}),
    # Windows shorter than the tests' prompts, so that every layer kind is exercised.
    "mistral-window": (MistralConfig, "MistralForCausalLM", {"sliding_window": 12}),
    "qwen2-window": (
        Qwen2Config,
        "Qwen2ForCausalLM",
        {
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": 10,
            "max_window_layers": 2,
            "rope_parameters": {"rope_theta": 1e6},
        },
    ),
    "gemma2": (
        Gemma2Config,
        "Gemma2ForCausalLM",
        {**_GEMMA, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0},
    ),  # fmt: skip
    "gemma3": (
        Gemma3TextConfig,
        "Gemma3ForCausalLM",
        {
            **_GEMMA,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 2
            + ["full_attention"]
            + ["sliding_attention"] * 2
            + ["full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
    ),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM", {"rope_parameters": {"rope_theta": 1e6}}),
    "qwen3": (
        Qwen3Config,
        "Qwen3ForCausalLM",
        {"head_dim": 24, "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e6}},
    ),
}


def make_hf_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config of checkpoint `arch` (a key of CHECKPOINTS)."""
    config_cls, architecture, settings = CHECKPOINTS[arch]
    kwargs = {"dtype": "float32", **_BASE, **settings, **overrides}
    return config_cls(architectures=[architecture], **kwargs)


def make_hf_model(
    arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> PreTrainedModel:
    """A random transformers model for `arch` (eager attention, eval mode), float32 unless
    `dtype` says otherwise. Weights, norms and biases are all random so no parameter
    hides behind a default."""
    config = make_hf_config(arch, dtype=str(dtype).removeprefix("torch."), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model.eval()


def make_checkpoint(
    tmp_path: Path,
    arch: str,
    max_shard_size: str | int | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Save a random `arch` checkpoint under `tmp_path/arch` and return its directory.

    `max_shard_size` (e.g. "100KB") splits it into several safetensors files with a
    `model.safetensors.index.json`, as large checkpoints are; `overrides` change config
    fields (e.g. `num_key_value_heads=4`)."""
    model = make_hf_model(arch, dtype=dtype, **overrides)
    out = tmp_path / arch
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out
