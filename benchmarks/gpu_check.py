"""The one check to run when a CUDA GPU is lent: correctness, speed and cost, in under 5
minutes on an H200, from a bare checkout (no install, no network, no server packages).

    PYTHONPATH=. python benchmarks/gpu_check.py --out-dir "$OUT"

The report (gpu_check.json in --out-dir) is rewritten after every row, so a time-out
keeps what ran. Rows run most decisive first, and any row that would start past
--budget-s is recorded as skipped:

1. TRITON_ATTN on a Llama-3.2-1B-shaped bf16 model: NONE against FULL_DECODE_ONLY at
   batch 1 (the whole step and the forward alone, CUDA events), beside the bandwidth
   floor: weights plus the KV read, over the device-to-device copy bandwidth measured
   here. The same engines' greedy outputs agree within vLLM's check_logprobs_close rule.
2. Correctness in float32 on a tiny model, every attention backend and graph mode: greedy
   ids equal NONE's, over staggered arrivals whose mixed batches fit the largest capture
   size, and the steps really ran in the graphs the mode promises (a silent fall-back to
   eager fails the row).
3. The other graph modes (and CUDA_TORCH's FULL_DECODE_ONLY) on the 1B shape: agreement
   with NONE in bf16, batch 1.
4. The rest of the latency grid: batch 1, 8, 32, 128 at contexts 128, 4k and 32k (where
   batch x context stays within --max-batch-tokens of KV to prefill), per mode.
5. Cost at the platform's default capture sizes (those up to max_num_seqs, 128):
   capture seconds and graph memory of FULL_DECODE_ONLY.

With no GPU it prints one line and exits 2. `--smoke` runs the same rows on the CPU with
tiny shapes (the test suite does, to keep the script working between GPU sessions).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from decodegraph import LLM, SamplingParams
from decodegraph.attention.selector import ENV_VAR
from decodegraph.benchmarks.accuracy import check_logprobs_close, first_divergence
from decodegraph.benchmarks.common import GRAPH_MODES

# Runtime modes a resolved graph mode must have run, by step kind ("decode", "mixed").
PROMISED = {
    "NONE": {},
    "PIECEWISE": {"decode": "PIECEWISE", "mixed": "PIECEWISE"},
    "FULL": {"decode": "FULL", "mixed": "FULL"},
    "FULL_DECODE_ONLY": {"decode": "FULL"},
    "FULL_AND_PIECEWISE": {"decode": "FULL", "mixed": "PIECEWISE"},
}


class Shapes:
    """What the rows run: the GPU's shapes, or tiny ones for --smoke on the CPU."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.big_model = "preset:llama-tiny" if smoke else "preset:llama-3.2-1b"
        self.big_dtype = "float32" if smoke else "bfloat16"
        self.batches = [1, 2] if smoke else [1, 8, 32, 128]
        self.contexts = [16, 64] if smoke else [128, 4096, 32768]
        self.steps = 4 if smoke else 24
        self.warm_steps = 1 if smoke else 3
        # Every 1B engine stays alive for the latency grid: six of these must fit.
        self.kv_bytes = (64 << 20) if smoke else (12 << 30)
        self.max_batch_tokens = 1 << 18
        self.backends = ["CPU_TORCH"] if smoke else ["TRITON_ATTN", "CUDA_TORCH"]
        self.tiny_sizes = [1, 2, 4, 8, 16, 32]
        # CPU graphs without Inductor: the smoke run checks the script, not speed.
        self.extra_cc: dict[str, Any] = {"use_inductor": False} if smoke else {}

    def sync(self) -> None:
        if not self.smoke:
            torch.cuda.synchronize()


class Report:
    """The JSON report, rewritten after every row."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.path = path
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.data: dict[str, Any] = {"rows": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def row(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if self.elapsed() > self.budget_s:
            result: dict[str, Any] = {"skipped": f"time budget of {self.budget_s:.0f} s spent"}
        else:
            t = time.perf_counter()
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - report every row, keep going
                traceback.print_exc()
                result = {"error": f"{type(e).__name__}: {e}"}
            result["row_s"] = round(time.perf_counter() - t, 2)
        self.data["rows"][name] = result
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        self.path.write_text(json.dumps(self.data, indent=2, default=str))
        print(f"[{self.elapsed():6.1f} s] {name}: {json.dumps(result, default=str)}", flush=True)
        return result


@contextlib.contextmanager
def _backend(name: str) -> Iterator[None]:
    os.environ[ENV_VAR] = name
    try:
        yield
    finally:
        del os.environ[ENV_VAR]


def measure_bandwidth(shapes: Shapes) -> float:
    """Device-to-device copy GB/s, counting bytes read and written."""
    n = (1 << 28) if not shapes.smoke else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=shapes.device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    shapes.sync()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        shapes.sync()
        times.append(time.perf_counter() - t)
    return 2 * n / statistics.median(times) / 1e9


# ---------------------------------------------------------------- engines


def big_engine(shapes: Shapes, mode: str, backend: str, sizes: list[int] | None = None) -> LLM:
    """The 1B-shaped model (tiny under --smoke), with an exact KV budget so engines built
    one after another do not depend on what the last one left."""
    cc = {"cudagraph_mode": mode, **shapes.extra_cc}
    if sizes is not None:
        cc["cudagraph_capture_sizes"] = sizes
    with _backend(backend):
        return LLM(
            shapes.big_model,
            load_format="dummy",
            dtype=shapes.big_dtype,
            device=shapes.device,
            max_model_len=max(shapes.contexts) + 2 * shapes.steps,
            max_num_seqs=max(shapes.batches),
            kv_cache_memory_bytes=shapes.kv_bytes,
            enable_prefix_caching=False,
            compilation_config=cc,
        )


def engine_cost(llm: LLM, startup_s: float) -> dict[str, Any]:
    gr = llm.llm_engine.runner.graph_runner
    return {
        "resolved": gr.mode.name,
        "backend": llm.llm_engine.runner.attn_backend.name,
        "startup_s": round(startup_s, 2),
        "capture_s": round(gr.stats.seconds, 2),
        "graphs": gr.stats.num_graphs,
        "graph_memory_mib": round(gr.stats.memory_bytes / 2**20, 1),
    }


def kv_bytes_per_token(llm: LLM) -> int:
    runner = llm.llm_engine.runner
    return runner.kv_cache_bytes_per_block() // runner.block_size


def weight_bytes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.llm_engine.runner.model.parameters())


def decode_latency(
    llm: LLM, shapes: Shapes, batch: int, context: int, bandwidth_gbs: float, tag: str
) -> dict[str, Any]:
    """Median decode step and forward (ms) of `batch` requests at `context` tokens."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    forwards: list[tuple[Any, Any]] = []
    forward = runner._forward

    def timed_forward(b: Any) -> Any:
        if shapes.smoke:
            t = time.perf_counter()
            out = forward(b)
            forwards.append((t, time.perf_counter()))
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(b)
        end.record()
        forwards.append((start, end))
        return out

    rng = random.Random(context * 1000 + batch)
    vocab = runner.vocab_size
    params = SamplingParams(
        temperature=0, max_tokens=shapes.warm_steps + shapes.steps + 4, ignore_eos=True
    )
    ids = [f"{tag}-{batch}-{context}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(
            rid, {"prompt_token_ids": [rng.randrange(vocab) for _ in range(context)]}, params
        )
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked) until every request decodes
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
    counts_before = dict(runner.graph_runner.mode_counts)
    step_times: list[float] = []
    runner._forward = timed_forward
    try:
        for _ in range(shapes.warm_steps + shapes.steps):
            shapes.sync()
            t = time.perf_counter()
            engine.step()
            shapes.sync()
            step_times.append(time.perf_counter() - t)
    finally:
        runner._forward = forward
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    if shapes.smoke:
        fwd = [b - a for a, b in forwards]
    else:
        fwd = [a.elapsed_time(b) / 1e3 for a, b in forwards]
    w = shapes.warm_steps
    ran = {
        f"{k[0]}:{k[1]}": v - counts_before.get(k, 0)
        for k, v in runner.graph_runner.mode_counts.items()
        if v - counts_before.get(k, 0)
    }
    floor_bytes = weight_bytes(llm) + batch * context * kv_bytes_per_token(llm)
    step_ms = statistics.median(step_times[w:]) * 1e3
    floor_ms = floor_bytes / (bandwidth_gbs * 1e9) * 1e3
    return {
        "step_ms": round(step_ms, 3),
        "forward_ms": round(statistics.median(fwd[w:]) * 1e3, 3),
        "floor_ms": round(floor_ms, 3),
        "step_over_floor": round(step_ms / floor_ms, 2),
        "tok_s": round(batch / (step_ms / 1e3), 1),
        "steps_by_mode": ran,
    }


def greedy_with_logprobs(llm: LLM, shapes: Shapes) -> list[tuple[list[int], list[dict]]]:
    rng = random.Random(7)
    vocab = llm.llm_engine.runner.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(3 + 5 * i)]} for i in range(6)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def agreement(ref: list, other: list, name: str) -> dict[str, Any]:
    try:
        check_logprobs_close(ref, other, "NONE", name)
        close = True
    except AssertionError as e:
        close = str(e)
    return {"logprobs_close": close, "first_divergence": first_divergence(ref, other)}


# ---------------------------------------------------------------- float32 correctness


def tiny_correctness(shapes: Shapes, backend: str, mode: str, reference: dict) -> dict[str, Any]:
    """Greedy ids of `mode` against NONE's, over staggered arrivals: decodes beside new
    prompts give mixed batches within the largest capture size."""
    cc = {"cudagraph_mode": mode, "cudagraph_capture_sizes": shapes.tiny_sizes, **shapes.extra_cc}
    with _backend(backend):
        llm = LLM(
            "preset:llama-tiny",
            load_format="dummy",
            dtype="float32",
            device=shapes.device,
            max_model_len=256,
            max_num_seqs=16,
            max_num_batched_tokens=32,
            kv_cache_memory_bytes=64 << 20,
            compilation_config=cc,
        )
    engine, gr = llm.llm_engine, llm.llm_engine.runner.graph_runner
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(1 + 3 * i)] for i in range(9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids: dict[str, list[int]] = {}
    step = 0
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # one new prompt every third step
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        for out in engine.step():
            ids[out.request_id] = out.outputs[0].token_ids
        step += 1
    got = [ids[f"r{i}"] for i in range(len(prompts))]
    # The same prompts alone (batch invariance across paddings and graph sizes).
    alone = llm.generate({"prompt_token_ids": prompts[4]}, params, use_tqdm=False)
    counts = {f"{k[0]}:{k[1]}": v for k, v in gr.mode_counts.items()}
    resolved = gr.mode.name
    missing = [
        f"{kind}:{runtime}"
        for kind, runtime in PROMISED[resolved].items()
        if not counts.get(f"{kind}:{runtime}")
    ]
    reference.setdefault(backend, got)
    row = {
        "resolved": resolved,
        "equal_to_none": got == reference[backend],
        "batch_invariant": alone[0].outputs[0].token_ids == got[4],
        "graph_steps_missing": missing,
        "steps_by_mode": counts,
    }
    # Batch invariance is reported, not required: a padded batch may take another
    # matmul kernel, which moves float32 results in their last bits.
    row["ok"] = row["equal_to_none"] and not missing
    del llm, engine, gr
    return row


# ---------------------------------------------------------------- main


def run(shapes: Shapes, report: Report) -> bool:
    data = report.data
    data.update(
        device=torch.cuda.get_device_name() if not shapes.smoke else "cpu (smoke)",
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    bandwidth = measure_bandwidth(shapes)
    data["copy_bandwidth_gbs"] = round(bandwidth, 1)
    engines: dict[str, LLM] = {}
    outputs: dict[str, list] = {}
    ok = True
    b1, c0 = shapes.batches[0], shapes.contexts[0]

    def build(name: str, mode: str, backend: str) -> Callable[[], dict[str, Any]]:
        def go() -> dict[str, Any]:
            t = time.perf_counter()
            llm = engines[name] = big_engine(shapes, mode, backend, shapes.batches)
            row = engine_cost(llm, time.perf_counter() - t)
            row["weight_gb"] = round(weight_bytes(llm) / 1e9, 3)
            outputs[name] = greedy_with_logprobs(llm, shapes)
            if name != reference_name and reference_name in outputs:
                row.update(agreement(outputs[reference_name], outputs[name], name))
            row.update(decode_latency(llm, shapes, b1, c0, bandwidth, name))
            return row

        return go

    backend = shapes.backends[0]
    reference_name = f"{backend}:NONE"
    first = [reference_name, f"{backend}:FULL_DECODE_ONLY"]
    later = [f"{backend}:{m}" for m in GRAPH_MODES if f"{backend}:{m}" not in first]
    if len(shapes.backends) > 1:
        later.append(f"{shapes.backends[1]}:FULL_DECODE_ONLY")
    for name in first:
        b, mode = name.split(":")
        row = report.row(f"1b {name} b{b1} ctx{c0}", build(name, mode, b))
        ok &= "error" not in row and row.get("logprobs_close", True) is True
    reference: dict[str, list] = {}
    for b in shapes.backends:
        for mode in GRAPH_MODES:
            row = report.row(
                f"tiny fp32 {b}:{mode}",
                lambda b=b, mode=mode: tiny_correctness(shapes, b, mode, reference),
            )
            ok &= bool(row.get("ok", "skipped" in row))
    for name in later:
        b, mode = name.split(":")
        row = report.row(f"1b {name} b{b1} ctx{c0}", build(name, mode, b))
        ok &= "error" not in row and row.get("logprobs_close", True) is True
    for context in shapes.contexts:
        for batch in shapes.batches:
            if (batch, context) == (b1, c0) or batch * context > shapes.max_batch_tokens:
                continue
            for name, llm in engines.items():
                report.row(
                    f"1b {name} b{batch} ctx{context}",
                    lambda llm=llm, batch=batch, context=context, name=name: decode_latency(
                        llm, shapes, batch, context, bandwidth, name
                    ),
                )
    engines.clear()
    gc.collect()
    if not shapes.smoke:
        torch.cuda.empty_cache()

    def default_sizes() -> dict[str, Any]:
        t = time.perf_counter()
        llm = big_engine(shapes, "FULL_DECODE_ONLY", backend)
        row = engine_cost(llm, time.perf_counter() - t)
        row["capture_sizes"] = len(llm.llm_engine.runner.graph_runner.capture_sizes)
        return row

    report.row("1b FULL_DECODE_ONLY default capture sizes", default_sizes)
    return ok


def print_table(report: Report) -> None:
    cols = ["step_ms", "forward_ms", "floor_ms", "step_over_floor", "capture_s", "graph_memory_mib"]
    print(
        f"\n{report.data.get('device')}, torch {report.data.get('torch')}, "
        f"copy {report.data.get('copy_bandwidth_gbs')} GB/s"
    )
    print(f"{'row':<48}" + "".join(f"{c:>18}" for c in cols) + "  agreement / error")
    for name, row in report.data["rows"].items():
        note = (
            row.get("error") or row.get("skipped") or row.get("logprobs_close", row.get("ok", ""))
        )
        print(f"{name:<48}" + "".join(f"{str(row.get(c, '-')):>18}" for c in cols) + f"  {note}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", default="benchmarks/results", help="where gpu_check.json goes")
    p.add_argument("--budget-s", type=float, default=270.0, help="start no row after this")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=1 << 18,
        help="skip latency rows whose batch x context exceeds this (KV to prefill)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (use --smoke to exercise the script on the CPU)",
            file=sys.stderr,
        )
        return 2
    shapes = Shapes(args.smoke)
    shapes.max_batch_tokens = args.max_batch_tokens
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out / "gpu_check.json", args.budget_s)
    ok = run(shapes, report)
    print_table(report)
    print(f"\nsaved {report.path}; correctness {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
