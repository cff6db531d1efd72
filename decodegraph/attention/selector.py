"""Which attention backend an engine runs: its platform's default, or the one named by
DECODEGRAPH_ATTENTION_BACKEND (vLLM users know this as VLLM_ATTENTION_BACKEND)."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from decodegraph.attention.backends.base import AttentionBackend

if TYPE_CHECKING:
    from decodegraph.platforms.base import Platform

ENV_VAR = "DECODEGRAPH_ATTENTION_BACKEND"

# name -> "module:class" (or the class); modules are imported only when chosen (triton
# is optional).
BACKENDS: dict[str, str | type[AttentionBackend]] = {
    "CPU_TORCH": "decodegraph.attention.backends.torch_paged:CPUAttentionBackend",
    "CUDA_TORCH": "decodegraph.attention.backends.torch_paged:CUDATorchAttentionBackend",
    "TRITON_ATTN": "decodegraph.attention.backends.triton_attn:TritonAttentionBackend",
}
_BUILT_IN = frozenset(BACKENDS)


def register_backend(name: str, backend: str | type[AttentionBackend]) -> None:
    """Make `backend` (a class, or "module:class") the one named `name`."""
    BACKENDS[name.upper()] = backend


def unregister_backend(name: str) -> None:
    """Forget a registered backend (the built-in ones stay)."""
    if name.upper() not in _BUILT_IN:
        BACKENDS.pop(name.upper(), None)


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name` (case-insensitive)."""
    path = BACKENDS.get(name.upper())
    if path is None:
        raise ValueError(
            f"{ENV_VAR}: unknown attention backend {name!r} (valid: {', '.join(BACKENDS)})"
        )
    if not isinstance(path, str):
        return path
    module, cls = path.split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ValueError(f"{ENV_VAR}: backend {name} cannot be used here: {e}") from e


def get_attn_backend(platform: Platform) -> type[AttentionBackend]:
    """The backend the environment names, else the platform's default one."""
    name = os.environ.get(ENV_VAR) or platform.default_attention_backend
    if name is None:
        raise ValueError(f"platform {platform.name} names no attention backend; set {ENV_VAR}")
    return backend_class(name)
