"""Flat engine arguments (Python keywords and CLI flags, spelled as vLLM's) and their
resolution into one validated `EngineConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from decodegraph.config import (
    EXECUTOR_BACKENDS,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_dtype,
)
from decodegraph.graphs.modes import CUDAGraphMode
from decodegraph.models.bundled import DEFAULT_MODEL, bundled_model_path
from decodegraph.platforms import platform_class, platform_names
from decodegraph.structured_output.config import StructuredOutputsConfig

logger = logging.getLogger(__name__)

# max_num_batched_tokens when neither it nor a platform default for the usage context is
# given (vLLM's DEFAULT_MAX_NUM_BATCHED_TOKENS).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class UsageContext(enum.Enum):
    """Who builds the engine (vLLM's names): some defaults differ between them."""

    ENGINE_CONTEXT = "ENGINE_CONTEXT"
    LLM_CLASS = "LLM_CLASS"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"


@dataclass
class EngineArgs:
    """Every engine option; `LLM(...)` keywords and CLI flags map onto these."""

    model: str
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    load_format: str = "auto"
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    max_logprobs: int = 20
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    num_scheduler_steps: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    worker_cls: str = ParallelConfig.worker_cls
    enforce_eager: bool = False
    compilation_config: CompilationConfig | dict | str | None = field(default=None)
    device: str = "auto"
    structured_outputs_config: StructuredOutputsConfig | dict | str | None = None

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
        """Add the engine flags (vLLM spellings) to `parser`."""
        g = parser.add_argument_group("engine")
        model_help = (
            "local directory, hub id, preset:NAME, or a bundled model's name (default: the "
            f"bundled demo model {DEFAULT_MODEL})"
        )
        if model_positional:
            g.add_argument("model", nargs="?", default=None, help=model_help)
        else:
            g.add_argument("--model", default=None, help=model_help)
        g.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id")
        g.add_argument("--revision", default=None)
        g.add_argument(
            "--dtype", default="auto", help="auto, float32, bfloat16, float16 (auto reads config)"
        )
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
        g.add_argument("--skip-tokenizer-init", action="store_true")
        g.add_argument(
            "--max-logprobs",
            type=int,
            default=20,
            help="most logprobs and prompt_logprobs a request may ask for; -1: no cap, "
            "so that -1 (every token of the vocabulary) is allowed",
        )
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        g.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
        )
        g.add_argument("--num-gpu-blocks-override", type=int, default=None)
        g.add_argument(
            "--kv-cache-dtype",
            default="auto",
            help="auto: the model's dtype (the only KV cache dtype in this release)",
        )
        g.add_argument("--max-num-seqs", type=int, default=256)
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument(
            "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
        )
        g.add_argument(
            "--num-scheduler-steps",
            type=int,
            default=1,
            help="decode steps per scheduling while every request decodes and none waits "
            "for a free sequence slot (vLLM's multi-step scheduling): less engine work per "
            "token, tokens arrive in bursts of this many",
        )
        g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
        g.add_argument(
            "--distributed-executor-backend",
            default=None,
            choices=list(EXECUTOR_BACKENDS),
            help="how ranks run: mp (processes, the default above -tp 1), ray (actors), uni",
        )
        g.add_argument("--nnodes", type=int, default=1, help="hosts the ranks span (mp)")
        g.add_argument("--node-rank", type=int, default=0, help="this host's index (0: driver)")
        g.add_argument(
            "--master-addr", default="127.0.0.1", help="node 0's address (loopback by default)"
        )
        g.add_argument(
            "--master-port",
            type=int,
            default=None,
            help="torch.distributed's port on node 0 (the driver's RPC listener takes the "
            "next one); default: a free port, one node only",
        )
        g.add_argument("--worker-cls", default=ParallelConfig.worker_cls, help=argparse.SUPPRESS)
        g.add_argument("--enforce-eager", action="store_true", help="never use graphs (mode NONE)")
        g.add_argument(
            "-O",
            "--compilation-config",
            default=None,
            help='JSON, e.g. \'{"cudagraph_mode": "FULL_DECODE_ONLY"}\'',
        )
        g.add_argument("--device", default="auto", choices=["auto", *platform_names()])
        g.add_argument(
            "--structured-outputs-config",
            default=None,
            help="JSON, e.g. '{\"disable_any_whitespace\": true}'",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine arguments of parsed flags; with no model given, the bundled demo
        model (and a line on stderr saying so)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        if values.get("model") is None:
            values["model"] = DEFAULT_MODEL
            print(
                f"no model given: using the bundled demo model {DEFAULT_MODEL} "
                f"({bundled_model_path(DEFAULT_MODEL)})",
                file=sys.stderr,
            )
        return cls(**values)

    def create_engine_config(
        self, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT
    ) -> EngineConfig:
        """Validate every field, read the checkpoint's config, fill the defaults (some
        depend on `usage_context` and the platform, as in vLLM)."""
        from decodegraph.models.loader import get_config_dtype, load_hf_config, resolve_model_path

        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            revision=self.revision,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            load_format=self.load_format,
            served_model_name=self.served_model_name,
            skip_tokenizer_init=self.skip_tokenizer_init,
            max_logprobs=self.max_logprobs,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            num_scheduler_steps=self.num_scheduler_steps,
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            worker_cls=self.worker_cls,
        )
        compilation_config = CompilationConfig.from_any(self.compilation_config)
        structured_outputs_config = StructuredOutputsConfig.from_any(self.structured_outputs_config)
        device_config = DeviceConfig(device=self.device)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager: must be a bool, got {self.enforce_eager!r}")

        path = resolve_model_path(self.model, self.revision)  # None for a preset
        hf_config = load_hf_config(model_config, path)
        model_config.model_path = path
        model_config.hf_config = hf_config
        model_config.dtype = parse_dtype(self.dtype, get_config_dtype(hf_config))
        if isinstance(self.dtype, str) and self.dtype == "auto":
            stored = model_config.dtype
            model_config.dtype, why = platform_class(device_config.device).auto_dtype(stored)
            logger.info(
                "dtype auto: %s for a %s checkpoint on %s (%s)",
                str(model_config.dtype).removeprefix("torch."),
                str(stored).removeprefix("torch."),
                device_config.device,
                why,
            )
        _check_kv_cache_dtype(cache_config.kv_cache_dtype, model_config.dtype)
        _check_tensor_parallel_size(hf_config, parallel_config.tensor_parallel_size)
        limit = _context_length(hf_config)
        if model_config.max_model_len is None:
            model_config.max_model_len = limit
        elif limit is not None and model_config.max_model_len > limit:
            raise ValueError(
                f"max_model_len: {model_config.max_model_len} exceeds the model's context "
                f"length ({limit})"
            )
        if scheduler_config.max_num_batched_tokens is None:
            scheduler_config.max_num_batched_tokens = _default_max_num_batched_tokens(
                scheduler_config, model_config.max_model_len, device_config.device, usage_context
            )
        if compilation_config.cudagraph_mode is None:
            compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=parallel_config,
            compilation_config=compilation_config,
            device_config=device_config,
            enforce_eager=self.enforce_eager,
            structured_outputs_config=structured_outputs_config,
        )


def _default_max_num_batched_tokens(
    sc: SchedulerConfig, max_model_len: int, device: str, usage_context: UsageContext
) -> int:
    """vLLM's rule: with chunked prefill, the platform's default for the usage context
    (a prompt longer than it is chunked); without, enough for a whole prompt. Never more
    than max_num_seqs full-length sequences."""
    if sc.enable_chunked_prefill:
        defaults = platform_class(device).default_max_num_batched_tokens
        tokens = defaults.get(usage_context.name, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    else:
        tokens = max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    return min(tokens, sc.max_num_seqs * max_model_len)


def _check_tensor_parallel_size(hf_config: Any, tp_size: int) -> None:
    """The model must split over the ranks: checked here, before any worker starts
    (the layers check again as they are built)."""
    from decodegraph.layers.linear import divide
    from decodegraph.models.llama import get_num_heads_per_rank

    get_num_heads_per_rank(hf_config, tp_size)
    divide(hf_config.intermediate_size, tp_size, "intermediate_size")


def _check_kv_cache_dtype(value: str, model_dtype: torch.dtype) -> None:
    """The KV cache holds the model's dtype: accept "auto" or that dtype's name, and say
    so for anything else (fp8 and other vLLM cache dtypes are not in this release)."""
    name = str(model_dtype).removeprefix("torch.")
    if value == "auto" or value == name:
        return
    raise ValueError(
        f"kv_cache_dtype: {value!r} is not supported; the KV cache holds the model's dtype "
        f"({name}): use 'auto'"
    )


def _context_length(hf_config: Any) -> int:
    length = getattr(hf_config, "max_position_embeddings", None)
    return int(length) if length else 2048
