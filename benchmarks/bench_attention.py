"""The native paged-attention kernel of this tree beside another tree's, in one process.

Kernel changes of a few percent drown in the noise between processes on a shared
machine (bench_kernels.py times each variant in a process of its own). Here each tree's
csrc/paged_attention.h is built into a small shared library (attention_case.cpp, with
hidden symbols so that each library calls its own kernel), both libraries load into this
process, and the rounds alternate between them on the same inputs: a step of every
layer, with the per-step time of each side the median of its rounds, and whether both
sides' outputs agree bit for bit. One build per vector ISA asked for (the kernels' own
flags, as decodegraph.native builds them); one thread.

Cases (float32, block size 16): stories260K's attention (8 heads of 8 over 4 KV heads)
at 256 requests and contexts 32, 100 and 200 over its 5 layers (bench_decode.py's
batched workload; out of the caches, as in the engine), and at 16 requests over one
layer (in L2), and at batch 1 (context 128, the mean of bench_decode.py's batch-1
request); Qwen2.5-0.5B's (14 heads of 64 over 2) at batch 1 and batch 64.

    python benchmarks/bench_attention.py --base-tree /tmp/base      # git archive of a base
    python benchmarks/bench_attention.py --isas avx2 --rounds 30
    python benchmarks/bench_attention.py --lockstep   # bench_decode's batched block order

Without --base-tree only this tree runs. Prints a table per ISA and saves JSON under
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (batch, context, heads, kv_heads, head_size, layers)
CASES: dict[str, tuple[int, int, int, int, int, int]] = {
    "stories260K b256 ctx32 x5": (256, 32, 8, 4, 8, 5),
    "stories260K b256 ctx100 x5": (256, 100, 8, 4, 8, 5),
    "stories260K b256 ctx200 x5": (256, 200, 8, 4, 8, 5),
    "stories260K b16 ctx112 (L2)": (16, 112, 8, 4, 8, 1),
    "stories260K b1 ctx128 x5": (1, 128, 8, 4, 8, 5),
    "0.5B b1 ctx1024": (1, 1024, 14, 2, 64, 1),
    "0.5B b64 ctx256": (64, 256, 14, 2, 64, 1),
}


def build(tree: Path, isa: str, out: Path) -> Path:
    """attention_case.cpp against `tree`'s kernel headers, for `isa`."""
    import torch
    from torch.utils.cpp_extension import get_cxx_compiler

    from decodegraph import native

    torch_dir = Path(torch.__file__).parent
    lib = out / f"attention_{isa}.so"
    cmd = [
        get_cxx_compiler(),  # $CXX, else c++: the compiler that builds the operators
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        "-fvisibility-inlines-hidden",
        *native._flag_sets(isa)[1],  # the kernels' flags for the ISA, without OpenMP
        "-I",
        str(tree / "decodegraph" / "native" / "csrc"),
        "-isystem",
        str(torch_dir / "include"),
        str(ROOT / "benchmarks" / "attention_case.cpp"),
        "-o",
        str(lib),
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]
    subprocess.run(cmd, check=True, timeout=600)
    return lib


class Side:
    """One tree's kernel, loaded from its library, with a case of each shape asked for."""

    def __init__(self, name: str, lib: Path, cases: list[str], lockstep: bool) -> None:
        self.name = name
        self.lib = ctypes.CDLL(str(lib), mode=ctypes.RTLD_LOCAL)
        i64 = ctypes.c_int64
        self.lib.dg_case_new.restype = ctypes.c_void_p
        self.lib.dg_case_new.argtypes = [i64] * 7
        self.lib.dg_case_time.restype = ctypes.c_double
        self.lib.dg_case_time.argtypes = [ctypes.c_void_p, i64]
        self.lib.dg_case_out.restype = ctypes.POINTER(ctypes.c_float)
        self.lib.dg_case_out.argtypes = [ctypes.c_void_p]
        self.lib.dg_case_free.argtypes = [ctypes.c_void_p]
        self.cases = {name: self.lib.dg_case_new(*CASES[name], int(lockstep)) for name in cases}

    def time(self, case: str, budget_us: float) -> float:
        """Microseconds per step: a warm-up step, then enough steps for `budget_us`."""
        handle = self.cases[case]
        first = self.lib.dg_case_time(handle, 1)
        if first < 0:
            raise RuntimeError(f"{self.name}: the kernel refused case {case!r}")
        return self.lib.dg_case_time(handle, max(3, int(budget_us / max(first, 1.0))))

    def output(self, case: str) -> bytes:
        batch, _, heads, _, head_size, _ = CASES[case]
        n = batch * heads * head_size
        return ctypes.string_at(self.lib.dg_case_out(self.cases[case]), n * 4)

    def close(self) -> None:
        for handle in self.cases.values():
            self.lib.dg_case_free(handle)


def run_isa(
    isa: str,
    trees: dict[str, Path],
    cases: list[str],
    rounds: int,
    budget_us: float,
    lockstep: bool,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench_attention_") as tmp:
        sides = []
        for name, tree in trees.items():
            out = Path(tmp) / name
            out.mkdir()
            sides.append(Side(name, build(tree, isa, out), cases, lockstep))
        times: dict[str, dict[str, list[float]]] = {s.name: {c: [] for c in cases} for s in sides}
        for _ in range(rounds):  # interleaved: each round, every case on every side
            for case in cases:
                for side in sides:
                    times[side.name][case].append(side.time(case, budget_us))
        same = {c: len({s.output(c) for s in sides}) == 1 for c in cases}
        for side in sides:
            side.close()
    result: dict[str, Any] = {"cases": {}}
    first = sides[0].name
    print(f"\n{isa}: microseconds per step, median of {rounds} interleaved rounds")
    header = f"{'case':<30}" + "".join(f"{s.name:>12}" for s in sides)
    print(header + ("   ratio  same bits" if len(sides) > 1 else ""))
    for case in cases:
        med = {s.name: statistics.median(times[s.name][case]) for s in sides}
        row = {
            "shape": CASES[case],
            "us": med,
            "rounds_us": {s.name: times[s.name][case] for s in sides},
        }
        line = f"{case:<30}" + "".join(f"{med[s.name]:>12.1f}" for s in sides)
        if len(sides) > 1:
            ratio = med[sides[-1].name] / med[first]
            row |= {"ratio": ratio, "same_bits": same[case]}
            line += f"{ratio:>8.3f}  {'yes' if same[case] else 'NO'}"
        result["cases"][case] = row
        print(line)
    if len(sides) > 1:
        print(f"(ratio: {sides[-1].name}'s time over {first}'s; below 1 is faster)")
    return result


def main() -> None:
    from decodegraph import native
    from decodegraph.benchmarks.common import write_json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-tree", help="a checkout of the commit to compare with (git archive)")
    p.add_argument("--isas", nargs="+", default=None, help="default: every ISA this machine runs")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--budget-ms", type=float, default=20.0, help="timed steps per round")
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="block ids as a fresh pool gives requests that started together (bench_decode's "
        "batched workload), not a random permutation",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_attention.json"))
    args = p.parse_args()
    isas = args.isas or [i for i in native.available_isas() if i != "scalar"]
    unknown = sorted(set(isas) - set(native.available_isas()))
    if unknown:
        p.error(f"--isas: {unknown} not run by this machine ({native.available_isas()})")
    trees = {"this": ROOT}
    if args.base_tree:
        base = Path(args.base_tree).resolve()
        if not (base / "decodegraph" / "native" / "csrc" / "paged_attention.h").is_file():
            p.error(f"--base-tree: no decodegraph/native/csrc/paged_attention.h under {base}")
        trees = {"base": base, "this": ROOT}
    results = {
        "threads": 1,
        "rounds": args.rounds,
        "lockstep": args.lockstep,
        "trees": {k: str(v) for k, v in trees.items()},
        "isas": {
            isa: run_isa(isa, trees, args.cases, args.rounds, args.budget_ms * 1e3, args.lockstep)
            for isa in isas
        },
    }
    print()
    write_json(args.out, "attention", results)


if __name__ == "__main__":
    main()
