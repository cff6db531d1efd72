"""gloo against the shared-memory all-reduce on two CPU ranks of one host, interleaved.

Two spawned ranks, each pinned to one core, make --calls all-reduces of float32 vectors
of a decode row of Qwen2.5-0.5B (896 values) and of 32 rows, with gloo's functional
all-reduce (loopback TCP) and with decodegraph_cpu::shm_all_reduce, in rounds (gloo,
shm, gloo, shm, ...) so that a noisy phase of a shared machine hits both. Per size and
kind: the median over rounds of each round's median call, in microseconds, and the
ceiling it is measured against: the time one core takes to copy the bytes
(torch's copy_ of the same tensor), which is what the shared-memory path does twice.

    python benchmarks/bench_all_reduce.py
    python benchmarks/bench_all_reduce.py --rounds 6 --calls 1000

Prints a table and saves benchmarks/results/bench_all_reduce.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decodegraph.benchmarks.common import print_table, write_json  # noqa: E402
from decodegraph.distributed import parallel_state as ps  # noqa: E402
from tests.utils.distributed import run_on_ranks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (896, 32 * 896)


def _median_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _measure(rounds: int, calls: int) -> dict[str, list[float]]:
    group = ps.get_tp_group()
    if group.shm is None:
        raise RuntimeError("this group has no shared-memory all-reduce")
    os.sched_setaffinity(0, {group.rank % (os.cpu_count() or 1)})

    def gloo(x: torch.Tensor) -> torch.Tensor:
        out = torch.ops._c10d_functional.all_reduce(x, "sum", group.group_name)
        return torch.ops._c10d_functional.wait_tensor(out)

    results: dict[str, list[float]] = {}
    for n in SIZES:
        x, y = torch.randn(n), torch.empty(n)
        kinds = {
            "gloo": lambda x=x: gloo(x),
            "shm": lambda x=x: group.shm.all_reduce(x),
            "copy": lambda x=x, y=y: y.copy_(x),
        }
        for _ in range(rounds):
            for kind, fn in kinds.items():
                results.setdefault(f"{n} {kind}", []).append(_median_call_us(fn, calls))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=300, help="calls per kind and round")
    p.add_argument("--output-json", default=str(RESULTS / "bench_all_reduce.json"))
    args = p.parse_args(argv)
    os.environ.pop("DECODEGRAPH_CPU_SHM_ALLREDUCE", None)
    rounds = run_on_ranks(_measure, 2, args.rounds, args.calls, timeout_s=600)[0]
    med = {k: statistics.median(v) for k, v in rounds.items()}
    rows = [
        [n, n * 4, med[f"{n} gloo"], med[f"{n} shm"], med[f"{n} gloo"] / med[f"{n} shm"],
         med[f"{n} copy"]]
        for n in SIZES
    ]  # fmt: skip
    print_table(["floats", "bytes", "gloo us", "shm us", "gloo / shm", "one copy us"], rows)
    write_json(
        args.output_json,
        "all_reduce",
        {
            "ranks": 2,
            "dtype": "float32",
            "calls": args.calls,
            "median_us": med,
            "rounds_us": rounds,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
