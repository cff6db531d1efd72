"""The native CPU operators per vector ISA build, and batch-1 decode with each, in one run.

Every variant is a build of decodegraph/native for one vector ISA, and a build loads once
per process: each variant runs in a worker process of its own, and the rounds alternate
between the workers (one at a time, so no two compete for the cores). Variants:

- avx512: the at::vec kernels built for AVX-512 (this machine's default, where it has it);
- avx2, scalar: the at::vec kernels built for AVX2, or the portable loops
  (DECODEGRAPH_CPU_ISA), the rest of torch unchanged;
- avx2-machine: an AVX2-only CPU as far as software can tell: ATEN_CPU_CAPABILITY=avx2
  (aten's kernels, Inductor's generated code and our build), MKL and oneDNN at AVX2;
- base-avx512, base-avx2-machine (with --base-tree, a checkout of an older commit): that
  tree's operators, the second as an AVX2-only CPU ran them (its portable loops, forced
  with the old DECODEGRAPH_CPU_NO_AVX512=1).

Per kernel: the median over --rounds rounds of the mean time of a call (after a warm-up),
on Qwen2.5-0.5B's shapes (hidden 896, MLP 4864, 14 heads of 64 over 2 KV heads) and on
stories260K's attention (8 heads of 8 over 4), at batch 1 and batch 64; and the few-rows
projection beside torch.mm at 2, 4 and 8 rows on the 0.5B's MLP weights, float32 and
bfloat16. End to end: the
bundled stories260K in FULL_DECODE_ONLY, one request of --tokens tokens from BOS per round
(bench_decode.py's loop), tokens/s as one over the median decode step.

    python benchmarks/bench_kernels.py                          # every variant, both parts
    python benchmarks/bench_kernels.py --variants avx512 avx2 --skip-kernels

Prints tables and saves JSON under benchmarks/results/. One intra-op thread everywhere.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Environment of each variant's worker (on top of the parent's).
VARIANTS: dict[str, dict[str, str]] = {
    "avx512": {"DECODEGRAPH_CPU_ISA": "avx512"},
    "avx2": {"DECODEGRAPH_CPU_ISA": "avx2"},
    "scalar": {"DECODEGRAPH_CPU_ISA": "scalar"},
    "avx2-machine": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
}
_AVX2_MACHINE = VARIANTS["avx2-machine"]
BASE_VARIANTS = {
    "base-avx512": {},
    "base-avx2-machine": {**_AVX2_MACHINE, "DECODEGRAPH_CPU_NO_AVX512": "1"},
}


# --- worker side ----------------------------------------------------------------------


def _attention_call(
    ops: Any,
    batch: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int = 16,
    dtype: Any = None,
    layers: int = 1,
) -> Any:
    """A decode step of `batch` requests of `context` positions through the attention op.
    With `layers`, each call is the next layer's, every layer with caches of its own, as
    in a model's step (past the last-level cache where they are large enough)."""
    import torch

    dtype = dtype or torch.float32
    gen = torch.Generator().manual_seed(0)
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req + 1
    shape = (num_blocks, kv_heads, head_size, block_size)
    caches = [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(layers)
    ]
    ids = torch.randperm(num_blocks - 1, generator=gen).to(torch.int32) + 1
    block_tables = ids.view(batch, blocks_per_req).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    # Each request's new token goes to its last position.
    last = block_tables[:, -1].long() * block_size + (context - 1) % block_size
    slot_mapping = last.contiguous()
    query = torch.randn(batch, heads * head_size, generator=gen).to(dtype)
    key = torch.randn(batch, kv_heads * head_size, generator=gen).to(dtype)
    value = torch.randn(batch, kv_heads * head_size, generator=gen).to(dtype)
    group = heads // kv_heads
    workspace = torch.empty(1, group * blocks_per_req * block_size + (head_size + 1) * block_size)
    num_reqs = torch.tensor([batch], dtype=torch.int32)
    scale = head_size**-0.5
    metadata = (slot_mapping, block_tables, qsl, seq_lens, num_reqs, scale, workspace)
    layer_caches = itertools.cycle(caches)

    def call() -> Any:
        return ops.paged_attention(query, key, value, *next(layer_caches), *metadata)

    return call


def _kernel_calls(ops: Any) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    calls = {
        "attention stories260K b1 ctx256": _attention_call(ops, 1, 256, 8, 4, 8),
        # bench_decode's batched step at mid and full length: five layers' caches.
        "attention stories260K b256 ctx100 x5": _attention_call(ops, 256, 100, 8, 4, 8, layers=5),
        "attention stories260K b256 ctx200 x5": _attention_call(ops, 256, 200, 8, 4, 8, layers=5),
        "attention 0.5B b1 ctx1024": _attention_call(ops, 1, 1024, 14, 2, 64),
        "attention 0.5B b64 ctx256": _attention_call(ops, 64, 256, 14, 2, 64),
        "attention 0.5B bf16 b1 ctx1024": _attention_call(
            ops, 1, 1024, 14, 2, 64, dtype=torch.bfloat16
        ),
        "attention d128 bs32 b1 ctx1024": _attention_call(ops, 1, 1024, 32, 8, 128, 32),
    }
    # Small decode batches through Qwen2.5-0.5B's MLP weights (35 and 17 MB), three
    # copies of each taken in turn so that each call reads its weight from memory, as
    # a step does: the few-rows product against torch.mm (BLAS).
    for (k, n), dtype in itertools.product(((896, 2 * 4864), (4864, 896)), (None, "bf16")):
        to = torch.bfloat16 if dtype else torch.float32
        weights = itertools.cycle([torch.randn(n, k, generator=gen).to(to) for _ in range(3)])
        for rows in (2, 4, 8):
            x = torch.randn(rows, k, generator=gen).to(to)
            shape = f"{n}x{k}{' bf16' if dtype else ''} b{rows}"
            if hasattr(ops, "linear_few_rows"):
                calls[f"linear_few_rows {shape}"] = lambda x=x, ws=weights: ops.linear_few_rows(
                    x, next(ws), None
                )
            calls[f"mm {shape}"] = lambda x=x, ws=weights: torch.mm(x, next(ws).t())
    for rows in (1, 64):
        x, res = torch.randn(rows, 896, generator=gen), torch.randn(rows, 896, generator=gen)
        w = torch.rand(896, generator=gen) + 0.5
        gate_up = torch.randn(rows, 2 * 4864, generator=gen)
        qk = torch.randn(rows, 16, 64, generator=gen)
        cos, sin = torch.randn(rows, 64, generator=gen), torch.randn(rows, 64, generator=gen)
        calls |= {
            f"rms_norm 896 b{rows}": lambda x=x, w=w: ops.rms_norm(x, w, 1e-6),
            f"fused_add_rms_norm 896 b{rows}": lambda x=x, r=res, w=w: ops.fused_add_rms_norm(
                x, r, w, 1e-6
            ),
            f"silu_and_mul 4864 b{rows}": lambda g=gate_up: ops.silu_and_mul(g),
            f"rotary 16x64 b{rows}": lambda q=qk, c=cos, s=sin: ops.rotary_embedding(q, c, s),
        }
    return calls


def _time_call(fn: Any, budget_s: float = 0.02) -> float:
    """Mean seconds of a call over about `budget_s` of calls (after a warm-up)."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s and n >= 5:
            return elapsed / n


def _worker(tokens: int, kernels: bool, e2e: bool) -> None:
    """Answer one line of JSON per command read from stdin: 'kernels' (per-kernel mean
    call seconds) or 'decode' (the decode step seconds of one batch-1 request)."""
    import torch

    from decodegraph.native import load_cpu_ops

    torch.set_num_threads(1)
    ops = load_cpu_ops()
    isa = ops.vector_isa() if ops is not None and hasattr(ops, "vector_isa") else "base"
    calls = _kernel_calls(ops) if kernels and ops is not None else {}
    llm = None
    if e2e:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_decode import DEFAULT_MODEL, _decode_steps

        from decodegraph import LLM

        llm = LLM(str(DEFAULT_MODEL), compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
    print(json.dumps({"ready": True, "isa": isa}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "kernels":
            out: dict[str, Any] = {name: _time_call(fn) for name, fn in calls.items()}
        elif cmd == "decode":
            steps, forwards = _decode_steps(llm, tokens)
            out = {"step_s": statistics.median(steps), "forward_s": statistics.median(forwards)}
        else:
            break
        print(json.dumps(out), flush=True)


# --- parent side ----------------------------------------------------------------------


class Worker:
    """One variant's worker process."""

    def __init__(self, name: str, args: argparse.Namespace, kernels: bool, e2e: bool) -> None:
        env = dict(os.environ, DECODEGRAPH_CPU_THREADS="1", **{**VARIANTS, **BASE_VARIANTS}[name])
        tree = args.base_tree if name in BASE_VARIANTS else str(ROOT)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
        cmd = [sys.executable, __file__, "--worker", "--tokens", str(args.tokens)]
        cmd += [] if kernels else ["--skip-kernels"]
        cmd += [] if e2e else ["--skip-e2e"]
        self.name = name
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.isa = self._read()["isa"]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited (code {self.proc.wait()})")
        return json.loads(line)

    def ask(self, cmd: str) -> dict[str, Any]:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _rounds(workers: list[Worker], cmd: str, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """`rounds` rounds of `cmd`, each round asking every worker once, in turn."""
    out: dict[str, list[dict[str, Any]]] = {w.name: [] for w in workers}
    for _ in range(rounds):
        for w in workers:
            out[w.name].append(w.ask(cmd))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=[*VARIANTS, *BASE_VARIANTS]
    )
    p.add_argument("--base-tree", help="a checkout of the commit the base-* variants run")
    p.add_argument("--rounds", type=int, default=7, help="interleaved kernel rounds")
    p.add_argument("--decode-rounds", type=int, default=8, help="interleaved decode rounds")
    p.add_argument("--tokens", type=int, default=256, help="batch-1 decode length")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_kernels.json"))
    args = p.parse_args()
    if args.worker:
        _worker(args.tokens, not args.skip_kernels, not args.skip_e2e)
        return

    from decodegraph.benchmarks.common import write_json

    if any(v in BASE_VARIANTS for v in args.variants) and not args.base_tree:
        p.error("the base-* variants need --base-tree")
    workers = []
    for name in args.variants:
        start = time.perf_counter()
        w = Worker(name, args, not args.skip_kernels, not args.skip_e2e)
        print(
            f"{name}: built for {w.isa}, ready in {time.perf_counter() - start:.0f} s", flush=True
        )
        workers.append(w)
    results: dict[str, Any] = {"threads": 1, "variants": {w.name: {"isa": w.isa} for w in workers}}
    try:
        if not args.skip_kernels:
            rounds = _rounds(workers, "kernels", args.rounds)
            names = list(rounds[workers[0].name][0])
            table = {
                w.name: {n: statistics.median(r[n] for r in rounds[w.name]) for n in names}
                for w in workers
            }
            for w in workers:
                results["variants"][w.name]["kernel_us"] = {
                    n: s * 1e6 for n, s in table[w.name].items()
                }
            base = workers[0].name
            print(f"\nper-call microseconds (median of {args.rounds} interleaved rounds)")
            print(f"{'kernel':<38}" + "".join(f"{w.name:>19}" for w in workers))
            for n in names:
                cells = ""
                for w in workers:
                    us, ratio = table[w.name][n] * 1e6, table[w.name][n] / table[base][n]
                    cells += f"{us:>11.2f} ({ratio:4.2f}x)"
                print(f"{n:<38}{cells}")
            print(f"(ratios: time over {base}'s; above 1 is slower)")
        if not args.skip_e2e:
            rounds = _rounds(workers, "decode", args.decode_rounds)
            print(
                f"\nstories260K FULL_DECODE_ONLY batch 1, {args.tokens} tokens, "
                f"median of {args.decode_rounds} interleaved rounds"
            )
            print(f"{'variant':<20}{'ISA':>8}{'tok/s':>9}{'step us':>9}{'forward us':>12}")
            first = None
            for w in workers:
                step = statistics.median(r["step_s"] for r in rounds[w.name])
                forward = statistics.median(r["forward_s"] for r in rounds[w.name])
                first = first or step
                results["variants"][w.name] |= {
                    "decode_tokens_per_s": 1 / step,
                    "decode_step_us": step * 1e6,
                    "decode_forward_us": forward * 1e6,
                    "decode_x_first": first / step,
                    "decode_rounds_step_us": [r["step_s"] * 1e6 for r in rounds[w.name]],
                }
                print(
                    f"{w.name:<20}{w.isa:>8}{1 / step:>9.0f}{step * 1e6:>9.1f}{forward * 1e6:>12.1f}"
                )
    finally:
        for w in workers:
            w.close()
    print()
    write_json(args.out, "kernels", results)


if __name__ == "__main__":
    main()
