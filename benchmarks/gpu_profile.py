"""Where a batch-1 decode step goes on a CUDA GPU, for the 1B shape of gpu_check.py:

1. the replayed full graph's own device time (replays back to back, CUDA events), beside
   the whole step and the bandwidth floor, and both again with the layers in torch ops
   rather than their fused Triton kernels (layers/triton_ops.py);
2. each weight's projection alone (torch's matmul at one row, as the model calls it),
   its time and the bandwidth it reaches: what the floor can be on this GPU;
3. the kernels of a replayed step (torch.profiler), largest first;
4. the eager step's host time (cProfile of engine.step(), NONE), largest first.

    PYTHONPATH=. python benchmarks/gpu_profile.py --out-dir "$OUT"

Writes gpu_profile.json and the two tables (gpu_profile_kernels.txt,
gpu_profile_eager_host.txt) as it goes. `--smoke` runs it on the CPU with tiny shapes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import Shapes, big_engine, measure_bandwidth, weight_bytes  # noqa: E402

from decodegraph import LLM, SamplingParams  # noqa: E402
from decodegraph.graphs.modes import RuntimeMode  # noqa: E402


def start_decoding(llm: LLM, context: int, tag: str) -> None:
    """One request of `context` prompt tokens, stepped until it decodes."""
    engine = llm.llm_engine
    rng = random.Random(1)
    prompt = [rng.randrange(llm.llm_engine.runner.vocab_size) for _ in range(context)]
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    engine.add_request(tag, {"prompt_token_ids": prompt}, params)
    for _ in range(4):
        engine.step()


def timed(fn: Any, shapes: Shapes, reps: int) -> float:
    """Median ms of fn() over `reps` calls, each between CUDA events (wall clock on CPU)."""
    times = []
    for _ in range(reps):
        if shapes.smoke:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_replay_ms(llm: LLM, shapes: Shapes) -> dict[str, Any]:
    """The size-1 full graph replayed 50 times back to back, per replay."""
    gr = llm.llm_engine.runner.graph_runner
    graphs = {key: g for (mode, key), g in gr.graphs.items() if mode is RuntimeMode.FULL}
    key = min(graphs, key=lambda k: k.num_tokens)
    graph = graphs[key]

    def fifty() -> None:
        for _ in range(50):
            graph._run()

    fifty()
    return {"graph": key.label(), "replay_ms": round(timed(fifty, shapes, 5) / 50, 4)}


def projections(llm: LLM, shapes: Shapes, bandwidth_gbs: float) -> list[dict[str, Any]]:
    """Each distinct weight shape of the model as a one-row matmul."""
    rows, seen = [], set()
    for name, p in llm.llm_engine.runner.model.named_parameters():
        if p.dim() != 2 or tuple(p.shape) in seen or "embed" in name:
            continue
        seen.add(tuple(p.shape))
        x = torch.randn(1, p.shape[1], dtype=p.dtype, device=p.device)
        ms = timed(lambda x=x, p=p: torch.nn.functional.linear(x, p), shapes, 50)
        gbs = p.numel() * p.element_size() / (ms / 1e3) / 1e9
        rows.append(
            {
                "weight": name,
                "shape": list(p.shape),
                "ms": round(ms, 4),
                "gbs": round(gbs, 1),
                "of_copy_bandwidth": round(gbs / bandwidth_gbs, 2),
            }
        )
    return rows


def torch_ops_graph(shapes: Shapes) -> dict[str, Any]:
    """The same graph and step with the layers in torch ops instead of the fused Triton
    kernels (DECODEGRAPH_CUDA_FUSED_OPS=0), for the difference they make."""
    from decodegraph.layers import triton_ops

    os.environ["DECODEGRAPH_CUDA_FUSED_OPS"] = "0"
    triton_ops._enabled.cache_clear()
    try:
        llm = big_engine(shapes, "FULL_DECODE_ONLY", shapes.backends[0], shapes.batches)
        start_decoding(llm, shapes.contexts[0], "torch-ops")
        row = graph_replay_ms(llm, shapes)
        row["step_ms"] = round(timed(llm.llm_engine.step, shapes, 30), 4)
        return row
    finally:
        del os.environ["DECODEGRAPH_CUDA_FUSED_OPS"]
        triton_ops._enabled.cache_clear()


def kernel_table(llm: LLM, shapes: Shapes, steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if shapes.smoke else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            llm.llm_engine.step()
        shapes.sync()
    events = prof.key_averages()
    for key in (
        ["cpu_time_total"] if shapes.smoke else ["self_device_time_total", "self_cuda_time_total"]
    ):
        try:
            return events.table(sort_by=key, row_limit=40, max_name_column_width=70)
        except (AttributeError, KeyError, ValueError):
            continue
    return events.table(row_limit=40)


def host_profile(llm: LLM, steps: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        llm.llm_engine.step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(35)
    return out.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_profile: no CUDA device here (use --smoke on the CPU)", file=sys.stderr)
        return 2
    shapes = Shapes(args.smoke)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"torch": torch.__version__}
    path = out / "gpu_profile.json"

    def save(name: str, value: Any) -> None:
        report[name] = value
        path.write_text(json.dumps(report, indent=2, default=str))
        print(f"{name}: {json.dumps(value, default=str)[:2000]}", flush=True)

    bandwidth = measure_bandwidth(shapes)
    save("copy_bandwidth_gbs", round(bandwidth, 1))
    backend = shapes.backends[0]
    full = big_engine(shapes, "FULL_DECODE_ONLY", backend, shapes.batches)
    save("weight_gb", round(weight_bytes(full) / 1e9, 3))
    start_decoding(full, shapes.contexts[0], "full")
    save("full_graph", graph_replay_ms(full, shapes))
    step_ms = timed(full.llm_engine.step, shapes, 30)
    save("full_step_ms", round(step_ms, 4))
    save("projections", projections(full, shapes, bandwidth))
    table = kernel_table(full, shapes, 10)
    (out / "gpu_profile_kernels.txt").write_text(table)
    print(table, flush=True)
    del full
    save("full_graph_torch_ops", torch_ops_graph(shapes))
    none = big_engine(shapes, "NONE", backend, shapes.batches)
    start_decoding(none, shapes.contexts[0], "none")
    save("none_step_ms", round(timed(none.llm_engine.step, shapes, 10), 4))
    host = host_profile(none, 10)
    (out / "gpu_profile_eager_host.txt").write_text(host)
    print(host, flush=True)
    eager = kernel_table(none, shapes, 3)
    (out / "gpu_profile_eager_ops.txt").write_text(eager)
    print(eager[:6000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
