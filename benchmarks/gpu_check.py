"""One short check to run whenever a CUDA GPU is lent (under 5 minutes on an H200).

1. Correctness: for every attention backend (TRITON_ATTN, CUDA_TORCH) and graph mode,
   greedy ids equal mode NONE's (float32 tiny model, batch sizes that need padding,
   mixed prompt lengths).
2. Speed: decode step latency per mode at batch 1, 8 and 32 for a Llama-3.2-1B-shaped
   bf16 dummy model (TRITON_ATTN; FULL_DECODE_ONLY also on CUDA_TORCH), beside the
   memory-bandwidth floor (weight bytes / HBM bandwidth).

    python benchmarks/gpu_check.py [--bandwidth-gbs 4800]

Prints a table and saves JSON to benchmarks/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from decodegraph import LLM, SamplingParams
from decodegraph.attention.selector import ENV_VAR
from decodegraph.benchmarks.common import GRAPH_MODES

BACKENDS = ["TRITON_ATTN", "CUDA_TORCH"]
ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _backend(name: str):  # noqa: ANN202
    os.environ[ENV_VAR] = name
    try:
        yield
    finally:
        del os.environ[ENV_VAR]


def _llm(model: str, mode: str, **kw: object) -> LLM:
    # A few sizes: the batch of 7 pads to 8, and capture stays seconds per engine.
    cc = {"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    return LLM(model, load_format="dummy", compilation_config=cc, **kw)


def check_correctness() -> dict[str, object]:
    """Greedy ids of every mode vs NONE on a float32 model."""
    prompts = [
        {"prompt_token_ids": [256] + [(13 * i + j) % 250 for j in range(1 + 5 * i)]}
        for i in range(7)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=256, max_num_seqs=16, gpu_memory_utilization=0.3)
    results: dict[str, object] = {}
    reference: dict[str, list[list[int]]] = {}  # per backend: its NONE ids
    for backend, mode in [(b, m) for b in BACKENDS for m in GRAPH_MODES]:
        row = f"{backend}:{mode}"
        try:
            with _backend(backend):
                llm = _llm("preset:llama-tiny", mode, **kw)
            ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            single = llm.generate(prompts[3], params, use_tqdm=False)[0].outputs[0].token_ids
            runner = llm.llm_engine.runner
            reference.setdefault(backend, ids)
            results[row] = {
                "backend": runner.attn_backend.name,
                "resolved": runner.graph_runner.mode.name,
                "graphs": runner.graph_runner.stats.num_graphs,
                "equal_to_none": ids == reference[backend],
                "equal_to_triton_none": ids == reference.get("TRITON_ATTN"),
                "batch_invariant": single == ids[3],
                "steps_by_mode": {
                    f"{k[0]}:{k[1]}": v for k, v in runner.graph_runner.mode_counts.items()
                },
            }
            del llm
        except Exception as e:  # noqa: BLE001 - report every mode, keep going
            results[row] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        torch.cuda.empty_cache()
        print("correctness", row, results[row], flush=True)
    return results


def measure_latency(bandwidth_gbs: float, batches: list[int], steps: int) -> dict[str, object]:
    results: dict[str, object] = {}
    rows = [("TRITON_ATTN", m) for m in GRAPH_MODES] + [("CUDA_TORCH", "FULL_DECODE_ONLY")]
    for backend, mode in rows:
        row_name = f"{backend}:{mode}"
        try:
            start = time.perf_counter()
            with _backend(backend):
                llm = LLM(
                    "preset:llama-3.2-1b",
                    load_format="dummy",
                    dtype="bfloat16",
                    max_model_len=1024,
                    max_num_seqs=max(batches),
                    gpu_memory_utilization=0.5,
                    compilation_config={
                        "cudagraph_mode": mode,
                        "cudagraph_capture_sizes": batches,
                    },
                )
            startup = time.perf_counter() - start
            engine = llm.llm_engine
            weight_bytes = sum(
                p.numel() * p.element_size() for p in engine.runner.model.parameters()
            )
            row: dict[str, object] = {
                "resolved": engine.runner.graph_runner.mode.name,
                "startup_s": round(startup, 1),
                "capture_s": round(engine.runner.graph_runner.stats.seconds, 2),
                "graphs": engine.runner.graph_runner.stats.num_graphs,
                "floor_ms": round(weight_bytes / (bandwidth_gbs * 1e9) * 1e3, 3),
            }
            for b in batches:
                params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
                for i in range(b):
                    engine.add_request(
                        f"{mode}-{b}-{i}", {"prompt_token_ids": [256, 1 + i]}, params
                    )
                times = []
                while engine.has_unfinished_requests():
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    engine.step()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                row[f"b{b}_ms"] = round(statistics.median(times[3:]) * 1e3, 3)
            results[row_name] = row
            del llm, engine
        except Exception as e:  # noqa: BLE001
            results[row_name] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        torch.cuda.empty_cache()
        print("latency", row_name, results[row_name], flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="HBM GB/s (H200: 4800)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return 0
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "correctness": check_correctness(),
        "latency": measure_latency(args.bandwidth_gbs, args.batches, args.steps),
    }
    print(f"\n{report['device']}, torch {report['torch']}")
    print(
        f"{'backend:mode':<32}{'resolved':<20}{'equal':>6}"
        + "".join(f"{f'b{b} ms':>9}" for b in args.batches)
        + f"{'floor ms':>10}{'capture s':>10}{'graphs':>7}"
    )
    for row in dict.fromkeys([*report["correctness"], *report["latency"]]):
        c, lat = report["correctness"].get(row, {}), report["latency"].get(row, {})
        print(
            f"{row:<32}{str(lat.get('resolved', c.get('resolved', '-'))):<20}"
            f"{str(c.get('equal_to_none', '-')):>6}"
            + "".join(f"{str(lat.get(f'b{b}_ms', '-')):>9}" for b in args.batches)
            + f"{str(lat.get('floor_ms', '-')):>10}{str(lat.get('capture_s', '-')):>10}"
            f"{str(lat.get('graphs', '-')):>7}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    ok = all(c.get("equal_to_none") for c in report["correctness"].values())
    print(f"\nsaved {out}; correctness {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
