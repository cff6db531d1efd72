"""bf16 against fp32 on the CPU, on one bf16 checkpoint: which one should `dtype="auto"`
pick?

Builds the engine twice on the same checkpoint (default: the Qwen2.5-0.5B-shaped random
bf16 one of bench_decode.py --mid-size), with dtype="float32" (weights upcast once at
load) and dtype="bfloat16", and runs batch-1 decode in rounds that alternate the two:
tokens/s (one over the median step), the fraction of the bandwidth floor, bf16 over fp32
per round (median), and whether the greedy ids agree.

The vector ISA is the process's: run it once as is and once narrowed, e.g.

    python benchmarks/bench_cpu_dtype.py
    DECODEGRAPH_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python benchmarks/bench_cpu_dtype.py

(DECODEGRAPH_CPU_ISA narrows the native kernels, ATEN_CPU_CAPABILITY torch's own, and
ONEDNN_MAX_CPU_ISA oneDNN's, whose bf16 matmuls otherwise use AVX512_BF16 where the CPU
has it.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402 (the benchmark's sibling module)
import peers  # noqa: E402

from decodegraph.benchmarks.common import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    default_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "decodegraph_mid"
    p.add_argument("--model", default=str(default_dir / "qwen2.5-0.5b-bfloat16"))
    p.add_argument("--mode", default="NONE")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="default: benchmarks/results/cpu_dtype_ISA.json")
    args = p.parse_args()
    os.environ["DECODEGRAPH_CPU_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    model = Path(args.model)
    if not (model / "config.json").exists():
        peers.make_mid_checkpoint(model, torch.bfloat16)

    from decodegraph.native import cpu_isa  # after the environment is set

    isa = f"{cpu_isa()} (torch {torch.backends.cpu.get_cpu_capability()})"
    bw = peers.measure_bandwidth()
    print(f"ISA {isa}; threads {args.threads}; bandwidth floor {bw.floor_gbs:.1f} GB/s")
    engines = {
        name: bench_decode.EngineSide(
            str(model),
            args.mode,
            True,
            dtype=name,
            max_model_len=args.tokens + 64,
            max_num_batched_tokens=256,
            kv_cache_memory_bytes=256 * 2**20,
            capture_sizes=[1],
        )
        for name in _DTYPES
    }
    rates: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(args.repeats):
        for name, side in engines.items():
            rates[name].append(side.batch1(args.tokens))
    params = bench_decode.SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ids = {
        n: list(e.llm.generate([{"prompt_token_ids": [1]}], params, use_tqdm=False)[0]
                .outputs[0].token_ids)
        for n, e in engines.items()
    }  # fmt: skip
    first_diff = next(
        (
            i
            for i, (a, b) in enumerate(zip(ids["float32"], ids["bfloat16"], strict=False))
            if a != b
        ),
        None,
    )
    result = {"isa": isa, "threads": args.threads, "bandwidth_gbs": bw.floor_gbs, "rows": {}}
    for name, dtype in _DTYPES.items():
        tok_s = statistics.median(rates[name])
        floor = peers.decode_bytes(model, dtype).floor_tokens_per_s(
            bw.floor_gbs, 1, (args.tokens + 1) / 2
        )
        result["rows"][name] = {
            "batch1_tokens_per_s": tok_s,
            "rounds": rates[name],
            "floor_fraction": tok_s / floor,
            "startup_s": engines[name].info["startup_s"],
        }
        print(f"{name:<10}{tok_s:>10.1f} tok/s{tok_s / floor:>8.3f} of the floor")
    ratio = statistics.median(
        b / f for b, f in zip(rates["bfloat16"], rates["float32"], strict=True)
    )
    result["bf16_x_fp32"] = ratio
    result["greedy_first_difference"] = first_diff
    print(f"bf16 x fp32: {ratio:.2f}; greedy ids first differ at {first_diff}")
    out = args.out or str(ROOT / "benchmarks" / "results" / f"cpu_dtype_{cpu_isa()}.json")
    write_json(out, "cpu_dtype", result)


if __name__ == "__main__":
    main()
