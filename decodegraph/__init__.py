"""decodegraph: an LLM inference engine whose decode step is one replayed graph."""

from decodegraph.config import CompilationConfig
from decodegraph.entrypoints.llm import LLM
from decodegraph.graphs.modes import CUDAGraphMode
from decodegraph.outputs import CompletionOutput, RequestOutput
from decodegraph.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CUDAGraphMode",
    "CompilationConfig",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
