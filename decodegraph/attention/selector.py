"""Which attention backend an engine runs: its platform's default, or the one named by
DECODEGRAPH_ATTENTION_BACKEND (vLLM users know this as VLLM_ATTENTION_BACKEND)."""

from __future__ import annotations

import importlib
import os

from decodegraph.attention.backends.base import AttentionBackend

ENV_VAR = "DECODEGRAPH_ATTENTION_BACKEND"

# name -> "module:class"; modules are imported only when chosen (triton is optional).
BACKENDS: dict[str, str] = {
    "CPU_TORCH": "decodegraph.attention.backends.torch_paged:CPUAttentionBackend",
    "CUDA_TORCH": "decodegraph.attention.backends.torch_paged:CUDATorchAttentionBackend",
    "TRITON_ATTN": "decodegraph.attention.backends.triton_attn:TritonAttentionBackend",
}


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name` (case-insensitive)."""
    path = BACKENDS.get(name.upper())
    if path is None:
        raise ValueError(
            f"{ENV_VAR}: unknown attention backend {name!r} (valid: {', '.join(BACKENDS)})"
        )
    module, cls = path.split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ValueError(f"{ENV_VAR}: backend {name} cannot be used here: {e}") from e


def get_attn_backend(default: str) -> type[AttentionBackend]:
    """The backend the environment names, else the platform's `default`."""
    return backend_class(os.environ.get(ENV_VAR) or default)
