"""What the `decodegraph bench` commands share: the machine they ran on, percentiles,
random prompts, engines per graph mode, and writing results."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decodegraph.graphs.modes import CUDAGraphMode

GRAPH_MODES = list(CUDAGraphMode.__members__)
PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_offline_args(parser: Any, name: str, plot_help: str) -> Any:
    """The engine's flags, then what `bench latency` and `bench throughput` share; returns
    the argument group for the benchmark's own flags."""
    from decodegraph.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group(name)
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    g.add_argument("--temperature", type=float, default=1.0, help="vLLM's default: 1.0")
    g.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="token ids only, no text (vLLM's flag): time the engine without decoding",
    )
    g.add_argument("--graph-modes", nargs="+", default=GRAPH_MODES, metavar="MODE")
    g.add_argument("--output-json", default=None, help="write the results to this JSON file")
    g.add_argument("--plot", default=None, metavar="FILE.png", help=plot_help)
    return g


def engines_per_mode(args: Any, max_batch: int) -> tuple[Any, dict[str, Any], int]:
    """The user's engine arguments, one `LLM` per graph mode sized for `max_batch`
    requests of `--input-len` + `--output-len` tokens (only NONE with --enforce-eager),
    and the model's vocabulary size (random prompts are drawn from it)."""
    import time

    from decodegraph.engine.arg_utils import EngineArgs

    for name in ("input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be at least 1")
    base = EngineArgs.from_cli_args(args)
    modes = ["NONE"] if base.enforce_eager else args.graph_modes
    overrides = sized_for(base, max_batch, args.input_len + args.output_len)
    engines = {}
    for mode in modes:
        start = time.perf_counter()
        engines[mode] = make_llm(engine_args_for_mode(base, mode, **overrides))
        print(f"{mode}: engine ready in {time.perf_counter() - start:.1f} s", flush=True)
    vocab_size = next(iter(engines.values())).llm_engine.vocab_size
    return base, engines, vocab_size


def offline_sampling_params(args: Any) -> Any:
    """`--output-len` tokens per request, EOS ignored, at `--temperature` (seeded when it
    samples, so that a run can be repeated), as text unless `--disable-detokenize`."""
    from decodegraph.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        ignore_eos=True,
        max_tokens=args.output_len,
        seed=0 if args.temperature > 0 else None,
        detokenize=not args.disable_detokenize,
    )


def machine() -> dict[str, Any]:
    """The CPU model and vector ISA (as `lscpu` names them), threads, torch, GPU."""
    model: str | None = None
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and model is None:
                model = value
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    isa = [name for name in ("avx512f", "avx2", "neon", "asimd", "sve") if name in flags]
    info = {
        "cpu": model,
        "isa": isa,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def percentiles(values: list[float], qs: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """numpy's default (linear) percentiles of `values`, keyed by `str(q)`; NaN when empty."""
    if not values:
        return {str(q): float("nan") for q in qs}
    return {str(q): float(v) for q, v in zip(qs, np.percentile(values, qs), strict=True)}


def summary(values: list[float], qs: tuple[int, ...] = PERCENTILES) -> dict[str, Any]:
    """Mean, median and percentiles of `values`."""
    return {
        "mean": statistics.fmean(values) if values else float("nan"),
        "median": statistics.median(values) if values else float("nan"),
        "percentiles": percentiles(values, qs),
    }


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of `length` random token ids (as vLLM's random dataset draws them)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def engine_args_for_mode(base: Any, mode: str, **overrides: Any) -> Any:
    """`base` (EngineArgs) with `cudagraph_mode` set to `mode` in its compilation config
    (everything else the user gave kept) and `overrides` applied."""
    from decodegraph.config import CompilationConfig

    cc = CompilationConfig.from_any(base.compilation_config)
    cc = dataclasses.replace(cc, cudagraph_mode=mode)
    return dataclasses.replace(base, compilation_config=cc, **overrides)


def make_llm(engine_args: Any) -> Any:
    """An offline `LLM` over `engine_args` (an EngineArgs)."""
    from decodegraph.entrypoints.llm import LLM

    fields = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
    return LLM(fields.pop("model"), **fields)


def sized_for(base: Any, max_batch: int, tokens_per_request: int) -> dict[str, Any]:
    """EngineArgs overrides that give `max_batch` requests of `tokens_per_request` tokens
    room, with a KV cache of about that size unless the user gave one: an engine per
    graph mode is alive at once, and a default-sized cache each might not fit."""
    overrides: dict[str, Any] = {}
    if base.max_num_seqs < max_batch:
        overrides["max_num_seqs"] = max_batch
    if base.kv_cache_memory_bytes is None and base.num_gpu_blocks_override is None:
        max_model_len = base.create_engine_config().model_config.max_model_len
        if tokens_per_request > max_model_len:
            raise ValueError(
                f"--input-len + --output-len ({tokens_per_request}) exceed the model's "
                f"max_model_len ({max_model_len})"
            )
        per_request = -(-tokens_per_request // base.block_size) + 1
        one_full_length = -(-max_model_len // base.block_size)
        overrides["num_gpu_blocks_override"] = 1 + max(one_full_length, max_batch * per_request)
    return overrides


def write_json(path: str | None, benchmark: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The result with its date and machine; written to `path` when given."""
    result = {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        **payload,
    }
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"saved {out}")
    return result


def finish(args: Any, benchmark: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Write the result (`--output-json`) and draw its figure (`--plot`); return it."""
    result = write_json(args.output_json, benchmark, payload)
    if args.plot:
        from decodegraph.benchmarks import plot

        getattr(plot, f"plot_{benchmark}")(result, args.plot)
    return result


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    """A plain aligned table (numbers right, text left)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    numeric = [all(isinstance(r[i], (int, float)) for r in rows) for i in range(len(header))]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        )

    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print(line(r))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
