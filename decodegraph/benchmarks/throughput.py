"""`decodegraph bench throughput`: offline throughput of many requests, per graph mode.

As vLLM's `vllm bench throughput` with its random dataset: `--num-prompts` prompts of
`--input-len` random tokens, each generating `--output-len` tokens (EOS ignored), handed
to `LLM.generate` at once; reported as requests/s, total tokens/s and output tokens/s.
Each graph mode (`--graph-modes`) gets an engine of its own; with `--num-iters` above 1
the runs go round robin over the modes and the median run counts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from decodegraph.benchmarks.common import (
    add_offline_args,
    engines_per_mode,
    finish,
    offline_sampling_params,
    print_table,
    random_prompts,
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = add_offline_args(parser, "throughput", "output tokens/s per graph mode")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests in the run")
    g.add_argument("--num-iters", type=int, default=1, help="runs per mode (median counts)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.num_prompts < 1 or args.num_iters < 1:
        raise ValueError("--num-prompts, --num-iters: must be at least 1")
    # Room for max_num_seqs requests at a time, not for all of them at once.
    base, engines, vocab = engines_per_mode(args, min(args.num_prompts, args.max_num_seqs))
    modes = list(engines)
    prompts = [
        {"prompt_token_ids": p}
        for p in random_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    ]
    params = offline_sampling_params(args)
    prompt_tokens = args.num_prompts * args.input_len
    output_tokens = args.num_prompts * args.output_len
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.num_iters):
        for mode in modes:
            start = time.perf_counter()
            outs = engines[mode].generate(prompts, params, use_tqdm=False)
            seconds[mode].append(time.perf_counter() - start)
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            if generated != output_tokens:
                raise RuntimeError(f"{mode}: {generated} tokens generated, not {output_tokens}")
    results, rows = {}, []
    for mode in modes:
        elapsed = statistics.median(seconds[mode])
        engine = engines[mode].llm_engine
        results[mode] = {
            "resolved_mode": engine.engine_core.graph_mode.name,
            "elapsed_time": elapsed,
            "runs": seconds[mode],
            "requests_per_s": args.num_prompts / elapsed,
            "tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
        }
        r = results[mode]
        rows.append(
            [mode, elapsed, r["requests_per_s"], r["tokens_per_s"], r["output_tokens_per_s"]]
        )
    print_table(["mode", "seconds", "requests/s", "total tok/s", "output tok/s"], rows)
    return finish(
        args,
        "throughput",
        {
            "model": base.model,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "temperature": args.temperature,
            "results": results,
        },
    )
