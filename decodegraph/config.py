"""One `EngineConfig` of sub-configs, validated once at construction.

Every bad value raises `ValueError` naming the field. Names follow vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from decodegraph.config_parsing import dataclass_from_any
from decodegraph.graphs.modes import CUDAGraphMode
from decodegraph.structured_output.config import StructuredOutputsConfig

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(value: str | torch.dtype, config_dtype: Any = None) -> torch.dtype:
    """Resolve `dtype` ("auto" reads the checkpoint's `torch_dtype`/`dtype`)."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"dtype: {value} is not supported (float32, bfloat16, float16)")
        return value
    if value == "auto":
        if isinstance(config_dtype, torch.dtype):
            return config_dtype if config_dtype in _DTYPES.values() else torch.float32
        if isinstance(config_dtype, str) and config_dtype in _DTYPES:
            return _DTYPES[config_dtype]
        return torch.float32
    if value not in _DTYPES:
        raise ValueError(f"dtype: {value!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[value]


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


@dataclass
class ModelConfig:
    """What model to run and how to read it."""

    model: str
    tokenizer: str | None = None  # defaults to the model directory
    revision: str | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None  # defaults to the checkpoint's context length
    seed: int = 0
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights)
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    # Most logprobs (`logprobs`, `prompt_logprobs`) a request may ask for; -1: no cap
    # (the vocabulary). vLLM's name and default.
    max_logprobs: int = 20
    # Resolved by EngineArgs.create_engine_config: the local directory (None for a
    # preset) and the Hugging Face config read from it.
    model_path: Any = None
    hf_config: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model: a local directory, a hub id or preset:NAME is required")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format: {self.load_format!r} is not one of auto, safetensors, dummy"
            )
        _positive("max_model_len", self.max_model_len, allow_none=True)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int):
            raise ValueError(f"max_logprobs: must be an integer, got {self.max_logprobs!r}")
        if self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs: must be >= 0, or -1 for no cap, got {self.max_logprobs}"
            )
        if self.served_model_name is None:
            self.served_model_name = self.model


@dataclass
class CacheConfig:
    """Paged KV cache: block size, memory budget and prefix caching."""

    block_size: int = 16
    # Bytes for the KV cache; None means: derive from gpu_memory_utilization on
    # GPU, or a fixed share of free host memory on CPU (see platforms).
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # vLLM's name. The cache holds the model's dtype: "auto", or that dtype's name
    # (checked against the model in EngineArgs.create_engine_config).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if not isinstance(self.kv_cache_dtype, str):
            raise ValueError(f"kv_cache_dtype: must be a string, got {self.kv_cache_dtype!r}")
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        _positive("num_gpu_blocks_override", self.num_gpu_blocks_override, allow_none=True)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256
    # None: the platform's default for chunked prefill, by usage context (vLLM's rule,
    # engine/arg_utils.py); without chunked prefill, max(max_model_len, 2048).
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # Decode steps run per scheduling (vLLM's multi-step scheduling): while every running
    # request is decoding and no waiting request could be admitted (none waits, or
    # max_num_seqs are running), one schedule() plans up to this many steps,
    # which the runner runs back to back; the scheduler, dispatch and output processing
    # then run once per batch of steps instead of once per token.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("num_scheduler_steps", self.num_scheduler_steps)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)


# The executors that distributed_executor_backend names (decodegraph/executor/).
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How many ranks, which executor runs them, and where they meet (vLLM's names).

    Every rank is one worker (`worker_cls`); with "mp" they are spawned processes, with
    "ray" Ray actors, with "uni" the one worker lives in the driver. Across `nnodes`
    hosts ("mp" only) node 0 runs the driver and its share of the ranks; each other node
    runs `decodegraph serve --headless`. torch.distributed meets at
    tcp://master_addr:master_port; the driver's RPC listener for other nodes' workers is
    at master_port + 1.
    """

    tensor_parallel_size: int = 1
    # None: "uni" at tensor_parallel_size 1 on one node, else "mp".
    distributed_executor_backend: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    # Loopback by default: a multi-node run names node 0's reachable address.
    master_addr: str = "127.0.0.1"
    # None: a free port (one node only; several nodes must agree on it).
    master_port: int | None = None
    # A qualified name, so that spawned processes and Ray actors can import it.
    worker_cls: str = "decodegraph.worker.worker.Worker"

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("nnodes", self.nnodes)
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if tp == 1 and nnodes == 1 else "mp"
        backend = self.distributed_executor_backend
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend: {backend!r} is not one of "
                f"{', '.join(EXECUTOR_BACKENDS)}"
            )
        if backend == "uni" and tp != 1:
            raise ValueError(
                "distributed_executor_backend: 'uni' runs one rank in the driver; "
                f"tensor_parallel_size {tp} needs 'mp' or 'ray'"
            )
        if tp % nnodes != 0:
            raise ValueError(
                f"tensor_parallel_size: {tp} is not a multiple of nnodes ({nnodes}): "
                "every node runs the same number of ranks"
            )
        if nnodes > 1 and backend != "mp":
            raise ValueError(
                f"nnodes: {nnodes} nodes need distributed_executor_backend 'mp' "
                f"(got {backend!r}; Ray places its actors on its own cluster's nodes)"
            )
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank: must be in [0, {nnodes}), got {self.node_rank!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(
                f"master_addr: must be a host name or address, got {self.master_addr!r}"
            )
        port = self.master_port
        if port is not None and (
            not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65534
        ):
            # 65534: the driver's RPC listener takes master_port + 1.
            raise ValueError(f"master_port: must be in [1, 65534], got {port!r}")
        if nnodes > 1 and port is None:
            raise ValueError(
                f"master_port: {nnodes} nodes must agree on it; give the same port to every node"
            )
        if not isinstance(self.worker_cls, str) or "." not in self.worker_cls:
            raise ValueError(
                f"worker_cls: a qualified class name (module.Class), got {self.worker_cls!r}"
            )

    @property
    def world_size(self) -> int:
        """Ranks in all: one tensor-parallel group."""
        return self.tensor_parallel_size

    @property
    def local_world_size(self) -> int:
        """Ranks on each node."""
        return self.tensor_parallel_size // self.nnodes


@dataclass
class CompilationConfig:
    """Graph capture settings, spelled as vLLM's `compilation_config`."""

    # None: the platform default (see README, "Graph modes").
    cudagraph_mode: CUDAGraphMode | str | None = None
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    cudagraph_num_of_warmups: int = 1
    # CPU graphs: compile the traced graph with Inductor (False: replay the trace as is).
    use_inductor: bool = True
    # Inductor options for CPU graphs (torch._inductor.config names), as vLLM's field.
    inductor_compile_config: dict[str, Any] = field(default_factory=dict)
    # With num_scheduler_steps > 1: capture, beside each full decode graph, one that runs
    # all the steps of a greedy batch (docs/design.md §3, "multi-step graphs").
    multi_step_graphs: bool = False
    # Uniform decode batches above the largest capture size: one graph, compiled for any
    # row count, instead of the eager model (docs/design.md §3, "dynamic decode graph"),
    # where the platform makes such graphs (CPU). Unset (the default): on one rank, made
    # on a thread of its own once the first such batch comes, those batches eager until
    # then; under tensor parallelism, none. true: made at start-up (every rank). false:
    # none (README, "Graph modes").
    dynamic_decode_graph: bool | None = None
    # Full decode graphs above the smallest decode size made when a batch first needs
    # them, on a thread of their own, those batches on a larger graph or eager until then
    # (docs/design.md §3), where the platform makes graphs in the background (CPU), on
    # one rank. Unset (the default): so with the platform's default sizes; sizes listed in
    # cudagraph_capture_sizes are all made at start-up. true: also the listed sizes.
    # false: every size at start-up (README, "Graph modes").
    decode_graphs_on_demand: bool | None = None

    def __post_init__(self) -> None:
        if self.cudagraph_mode is not None:
            self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if not isinstance(sizes, (list, tuple)) or not sizes:
                raise ValueError(
                    "compilation_config.cudagraph_capture_sizes: must be a non-empty list"
                )
            for s in sizes:
                _positive("compilation_config.cudagraph_capture_sizes[]", s)
            self.cudagraph_capture_sizes = sorted(set(sizes))
        _positive(
            "compilation_config.max_cudagraph_capture_size",
            self.max_cudagraph_capture_size,
            allow_none=True,
        )
        if not isinstance(self.cudagraph_num_of_warmups, int) or self.cudagraph_num_of_warmups < 0:
            raise ValueError("compilation_config.cudagraph_num_of_warmups: must be >= 0")
        if not isinstance(self.multi_step_graphs, bool):
            raise ValueError("compilation_config.multi_step_graphs: must be true or false")
        if self.dynamic_decode_graph is not None and not isinstance(
            self.dynamic_decode_graph, bool
        ):
            raise ValueError(
                "compilation_config.dynamic_decode_graph: must be true, false or unset (null)"
            )
        if self.decode_graphs_on_demand is not None and not isinstance(
            self.decode_graphs_on_demand, bool
        ):
            raise ValueError(
                "compilation_config.decode_graphs_on_demand: must be true, false or unset (null)"
            )

    @classmethod
    def from_any(cls, value: CompilationConfig | dict | str | None) -> CompilationConfig:
        """Accept a `CompilationConfig`, a dict, a JSON string, or None."""
        return dataclass_from_any(cls, value, "compilation_config")


@dataclass
class DeviceConfig:
    # A platform's name (decodegraph/platforms: cpu, cuda, or a registered one), or
    # auto: cuda where a CUDA device is, else cpu.
    device: str = "auto"

    def __post_init__(self) -> None:
        from decodegraph.platforms import platform_names

        names = platform_names()
        if self.device != "auto" and self.device not in names:
            raise ValueError(f"device: {self.device!r} is not one of auto, {', '.join(names)}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but no CUDA device is available")


@dataclass
class EngineConfig:
    """The one aggregate that flows into every component."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    enforce_eager: bool = False
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
