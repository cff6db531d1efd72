"""decodegraph: an LLM inference engine whose decode step is one replayed graph.

The names below are loaded on first use, so that importing one part of the package
(`decodegraph.graphs.modes`, say) loads neither transformers nor the engine.
"""

from __future__ import annotations

import atexit
import importlib
from typing import TYPE_CHECKING, Any

from decodegraph.gc_utils import collector_paused, freeze_at_exit

__version__ = "0.1.0"

# The teardown's collections skip what the process made (gc_utils.freeze_at_exit). atexit
# runs its handlers last-in, first-out, so those registered by later imports still run
# (and collect) first.
atexit.register(freeze_at_exit)

_EXPORTS = {
    "LLM": "decodegraph.entrypoints.llm",
    "CUDAGraphMode": "decodegraph.graphs.modes",
    "CompilationConfig": "decodegraph.config",
    "CompletionOutput": "decodegraph.outputs",
    "RequestOutput": "decodegraph.outputs",
    "SamplingParams": "decodegraph.sampling_params",
}
__all__ = [
    "LLM",
    "CUDAGraphMode",
    "CompilationConfig",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from decodegraph.config import CompilationConfig
    from decodegraph.entrypoints.llm import LLM
    from decodegraph.graphs.modes import CUDAGraphMode
    from decodegraph.outputs import CompletionOutput, RequestOutput
    from decodegraph.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'decodegraph' has no attribute {name!r}")
    with collector_paused():  # torch, transformers, Dynamo (gc_utils)
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
