"""`decodegraph bench latency`: the end-to-end latency of one batch, per graph mode.

As vLLM's `vllm bench latency`: a batch of `--batch-size` prompts of `--input-len`
random tokens generates `--output-len` tokens each (EOS ignored), `--num-iters-warmup`
times untimed, then `--num-iters` times timed; the latency of an iteration is the whole
`LLM.generate` call. Here each graph mode (`--graph-modes`) gets an engine of its own,
and with several batch sizes (`--batch-size 1 8 32`) the iterations run round robin over
every mode and size, so that a noisy period of the machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from decodegraph.benchmarks.common import (
    add_offline_args,
    engines_per_mode,
    finish,
    offline_sampling_params,
    print_table,
    random_prompts,
    summary,
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = add_offline_args(parser, "latency", "tokens/s per graph mode and batch size")
    g.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=[8],
        help="requests per batch (several: a sweep)",
    )
    g.add_argument("--num-iters-warmup", type=int, default=10)
    g.add_argument("--num-iters", type=int, default=30)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = sorted(set(args.batch_size))
    if sizes[0] < 1 or args.num_iters < 1:
        raise ValueError("--batch-size, --num-iters: must be at least 1")
    base, engines, vocab = engines_per_mode(args, max(sizes))
    modes = list(engines)
    batches = {
        b: [{"prompt_token_ids": p} for p in random_prompts(b, args.input_len, vocab, seed=b)]
        for b in sizes
    }
    params = offline_sampling_params(args)

    def once(mode: str, size: int) -> float:
        start = time.perf_counter()
        engines[mode].generate(batches[size], params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        for mode in modes:
            for size in sizes:
                once(mode, size)
    latencies: dict[str, dict[int, list[float]]] = {m: {b: [] for b in sizes} for m in modes}
    for _ in range(args.num_iters):
        for mode in modes:
            for size in sizes:
                latencies[mode][size].append(once(mode, size))

    results: dict[str, Any] = {}
    rows = []
    for mode in modes:
        engine = engines[mode].llm_engine
        per_size = {}
        for size in sizes:
            stats = summary(latencies[mode][size])
            per_size[str(size)] = {
                "avg_latency": stats["mean"],
                "latencies": latencies[mode][size],
                "percentiles": stats["percentiles"],
                "output_tokens_per_s": size * args.output_len / stats["median"],
            }
            p = stats["percentiles"]
            rows.append(
                [
                    mode,
                    size,
                    1e3 * stats["mean"],
                    1e3 * p["50"],
                    1e3 * p["99"],
                    per_size[str(size)]["output_tokens_per_s"],
                ]
            )
        results[mode] = {
            "resolved_mode": engine.engine_core.graph_mode.name,
            "num_graphs": engine.engine_core.capture_stats.num_graphs,
            "batch_sizes": per_size,
        }
    print_table(["mode", "batch", "avg ms", "p50 ms", "p99 ms", "output tok/s"], rows)
    return finish(
        args,
        "latency",
        {
            "model": base.model,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "temperature": args.temperature,
            "num_iters": args.num_iters,
            "num_iters_warmup": args.num_iters_warmup,
            "results": results,
        },
    )
