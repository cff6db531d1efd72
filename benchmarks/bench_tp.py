"""Tensor parallelism on the CPU: tensor_parallel_size 2 beside 1, in one interleaved run.

A Qwen2.5-0.5B-shaped random checkpoint (benchmarks/peers.py, written once under
--model-dir) runs in FULL_DECODE_ONLY at tensor_parallel_size 1 (one process, --threads
intra-op threads) and 2 (two worker processes, each pinned to its share of the cores, so
two ranks on two cores have one thread each), both engines alive at once and run in
rounds (TP 1, then TP 2), so that a noisy phase of this shared machine hits both sides
of the ratio:
- batch 1: one request of --tokens tokens from BOS; tokens/s is one over the median
  decode-step time (the engine's whole step, driver and workers);
- batch --batch: that many requests of --tokens tokens, tokens over wall time.

A CPU's ranks share its memory bandwidth, which is what a decode step is bound by; what
two ranks gain is the second core's compute, what they pay is an all-reduce after every
attention block and MLP (gloo over loopback) and the driver-to-worker messages. On one
GPU tensor parallelism cannot be measured at all: it needs two devices.

    python benchmarks/bench_tp.py                  # ~minutes on 2 cores
    python benchmarks/bench_tp.py --dtype bfloat16 --rounds 5
    python benchmarks/bench_tp.py --gloo           # TP 2's all-reduces over gloo

Prints a table and saves benchmarks/results/bench_tp.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402

from decodegraph.benchmarks.common import print_table, write_json  # noqa: E402
from decodegraph.entrypoints.llm import LLM  # noqa: E402
from decodegraph.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def decode_step_seconds(llm: LLM, tokens: int) -> list[float]:
    """One batch-1 request stepped by hand: each decode step's seconds (prefill dropped)."""
    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    engine.add_request(f"b1-{time.monotonic_ns()}", {"prompt_token_ids": [1]}, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps[1:]


def batched_tokens_per_s(llm: LLM, batch: int, tokens: int) -> float:
    prompts = [{"prompt_token_ids": [1, 30 + i % 200]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def build(path: Path, tp: int, args: argparse.Namespace) -> tuple[LLM, float]:
    start = time.perf_counter()
    llm = LLM(
        str(path),
        tensor_parallel_size=tp,
        dtype=args.dtype,
        max_model_len=args.tokens + 16,
        max_num_seqs=args.batch,
        skip_tokenizer_init=True,
        compilation_config={
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": [1, args.batch],
        },
    )
    return llm, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/decodegraph-bench/qwen2.5-0.5b"))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="TP 1's intra-op threads"
    )
    p.add_argument(
        "--gloo", action="store_true", help="TP 2's all-reduces over gloo, not shared memory"
    )
    p.add_argument("--output-json", default=str(RESULTS / "bench_tp.json"))
    args = p.parse_args(argv)
    if args.gloo:
        os.environ["DECODEGRAPH_CPU_SHM_ALLREDUCE"] = "0"  # the workers inherit it

    dtype = getattr(torch, args.dtype)
    path = peers.make_mid_checkpoint(
        args.model_dir.with_name(f"{args.model_dir.name}-{args.dtype}"), dtype
    )
    print(f"checkpoint: {path}")
    os.environ["DECODEGRAPH_CPU_THREADS"] = str(args.threads)  # TP 1 runs in this process
    engines: dict[int, LLM] = {}
    startup: dict[int, float] = {}
    for tp in (1, 2):
        if tp == 2:
            # Each rank gets its share of the cores (the executor's default), not TP 1's.
            del os.environ["DECODEGRAPH_CPU_THREADS"]
        engines[tp], startup[tp] = build(path, tp, args)
        print(f"TP {tp}: ready in {startup[tp]:.1f} s")

    b1: dict[int, list[float]] = {1: [], 2: []}
    batched: dict[int, list[float]] = {1: [], 2: []}
    for r in range(args.rounds):
        for tp, llm in engines.items():
            b1[tp].append(1.0 / statistics.median(decode_step_seconds(llm, args.tokens)))
            batched[tp].append(batched_tokens_per_s(llm, args.batch, args.tokens))
        print(
            f"round {r + 1}: batch 1 {b1[1][-1]:.1f} / {b1[2][-1]:.1f} tok/s, batch "
            f"{args.batch} {batched[1][-1]:.1f} / {batched[2][-1]:.1f} tok/s (TP 1 / TP 2)"
        )
    for llm in engines.values():
        llm.llm_engine.shutdown()

    def ratio(values: dict[int, list[float]]) -> float:
        return statistics.median(b / a for a, b in zip(values[1], values[2], strict=True))

    rows: list[dict[str, Any]] = []
    for tp in (1, 2):
        rows.append(
            {
                "tensor_parallel_size": tp,
                "batch1_tokens_per_s": statistics.median(b1[tp]),
                f"batch{args.batch}_tokens_per_s": statistics.median(batched[tp]),
                "startup_s": startup[tp],
                "batch1_rounds": b1[tp],
                "batched_rounds": batched[tp],
            }
        )
    print_table(
        ["TP", "batch 1 tok/s", f"batch {args.batch} tok/s", "start-up s"],
        [
            [r["tensor_parallel_size"], r["batch1_tokens_per_s"],
             r[f"batch{args.batch}_tokens_per_s"], r["startup_s"]]
            for r in rows
        ],
    )  # fmt: skip
    print(
        f"TP 2 / TP 1 (median of per-round ratios): batch 1 {ratio(b1):.2f}x, "
        f"batch {args.batch} {ratio(batched):.2f}x"
    )
    write_json(
        args.output_json,
        "tp",
        {
            "model": "Qwen2.5-0.5B-shaped, random weights",
            "dtype": args.dtype,
            "tokens": args.tokens,
            "batch": args.batch,
            "rounds": args.rounds,
            "tp2_all_reduce": "gloo" if args.gloo else "shared memory where available",
            "tp1_threads": args.threads,
            "rows": rows,
            "ratio_batch1": ratio(b1),
            "ratio_batched": ratio(batched),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
