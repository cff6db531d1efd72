"""Serving per graph mode, over a concurrency sweep: what `decodegraph bench serve` does
against one server, here against one `decodegraph serve` per mode, in one run.

For each mode it starts `decodegraph serve` on loopback (a subprocess), sends
`--num-warmups` untimed requests, and runs `decodegraph bench serve`
(decodegraph/benchmarks/serve.py) at every `--concurrency`, all requests sent at once;
the NONE row at the same concurrency is the ceiling a graph mode is measured against.
Each row also holds the server's start-up seconds and its forward steps per runtime
graph mode during that level (from /metrics). Prints a table and saves JSON.

    python benchmarks/bench_serve.py                            # NONE and FULL_DECODE_ONLY
    python benchmarks/bench_serve.py --concurrency 1 8 --num-prompts 32
"""

from __future__ import annotations

import argparse
import json
import math
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from decodegraph.benchmarks import serve
from decodegraph.benchmarks.common import print_table, write_json
from decodegraph.models.bundled import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: str, mode: str, port: int, extra: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`decodegraph serve` on loopback in `mode` (in `env`, default this process's);
    returns once /health answers."""
    cmd = [sys.executable, "-m", "decodegraph.entrypoints.cli", "serve", model,
           "--port", str(port), "--uvicorn-log-level", "warning",
           "--compilation-config", json.dumps({"cudagraph_mode": mode}), *extra]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 600  # graph capture (and Inductor) can take a while
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--modes", nargs="+", default=["NONE", "FULL_DECODE_ONLY"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 4 x concurrency")
    parser.add_argument("--random-input-len", type=int, default=16)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--num-warmups", type=int, default=4, help="untimed requests per server")
    parser.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_serve.json"))
    args = parser.parse_args()

    rows, table = [], []
    for mode in args.modes:
        port = _free_port()
        started = time.perf_counter()
        proc = start_server(args.model, mode, port, args.server_arg)
        startup_s = time.perf_counter() - started
        try:
            for row in _sweep(args, f"http://127.0.0.1:{port}"):
                rows.append({"mode": mode, "startup_s": startup_s, **row})
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    base = {r["concurrency"]: r["output_throughput"] for r in rows if r["mode"] == "NONE"}
    for r in rows:
        ratio = r["output_throughput"] / base.get(r["concurrency"], math.nan)
        ttft, itl = r["ttft_ms"], r["itl_ms"]
        table.append([r["mode"], r["concurrency"], r["output_throughput"], ratio,
                      ttft["median"], ttft["percentiles"]["99"], itl["median"],
                      itl["percentiles"]["99"]])  # fmt: skip
    print_table(["mode", "conc", "tok/s", "x NONE", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"],
                table)  # fmt: skip
    write_json(
        args.out,
        "serve-per-mode",
        {
            "model": args.model,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "num_warmups": args.num_warmups,
            "rows": rows,
        },
    )


def _sweep(args: argparse.Namespace, base_url: str) -> list[dict]:
    """One server: the warm-up, then `bench serve` at every concurrency level."""
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    bench = parser.parse_args(
        ["--base-url", base_url, "--tokenizer", args.model,
         "--random-input-len", str(args.random_input_len),
         "--random-output-len", str(args.random_output_len), "--ignore-eos",
         "--num-warmups", str(args.num_warmups)]
    )  # fmt: skip
    target = serve.prepare(bench)  # the model list and the tokenizer, once per server
    serve.warm_up(bench, target)
    rows = []
    for c in args.concurrency:
        level = argparse.Namespace(**vars(bench))
        level.num_prompts = args.num_prompts or max(16, 4 * c)
        level.max_concurrency = c
        level.num_warmups = 0  # the server is warm
        before = _graph_runs(base_url)
        run = serve.run(level, target)["runs"][0]
        after = _graph_runs(base_url)
        graph_runs = {m: n - before.get(m, 0) for m, n in after.items()}
        rows.append({"concurrency": c, **run, "graph_runs": graph_runs})
    return rows


def _graph_runs(base_url: str) -> dict[str, int]:
    """The server's forward steps so far per runtime graph mode (NONE, PIECEWISE, FULL)."""
    runs = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("decodegraph:graph_runs_total{"):
            labels, _, value = line.rpartition(" ")
            mode = re.search(r'mode="([^"]*)"', labels)
            if mode:
                runs[mode.group(1)] = int(float(value))
    return runs


if __name__ == "__main__":
    main()
