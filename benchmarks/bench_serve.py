"""Serving latency and throughput per graph mode, over a concurrency sweep, in one run.

For each mode it starts `decodegraph serve` on loopback (a subprocess), then for each
concurrency level runs `--num-prompts` streamed completions from that many concurrent
clients, and measures:
- TTFT: request sent to the first streamed token, p50 and p99;
- ITL: time between streamed tokens of one request, p50 and p99;
- output tokens/s: completion tokens (from usage) over the level's wall time.

The ceiling printed beside each mode is the NONE row at the same concurrency (the
speed-up a graph mode gives). Prints a table and saves JSON under benchmarks/results/.

    python benchmarks/bench_serve.py                            # NONE and FULL_DECODE_ONLY
    python benchmarks/bench_serve.py --concurrency 1 8 --num-prompts 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "stories260K"
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Ben went to the park. They saw",
    "One day, a big bird",
    "Tom had a red ball.",
    "Mom said",
]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, mode: str, port: int, extra: list[str]) -> subprocess.Popen:
    """`decodegraph serve` on loopback in `mode`; returns once /health answers."""
    cmd = [
        sys.executable,
        "-m",
        "decodegraph.entrypoints.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--uvicorn-log-level",
        "warning",
        "--compilation-config",
        json.dumps({"cudagraph_mode": mode}),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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


async def _one(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    token_times: list[float] = []
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                token_times.append(time.perf_counter())
    itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    return {
        "ttft": token_times[0] - sent if token_times else float("nan"),
        "itl": itl,
        "tokens": tokens,
    }


async def run_level(base_url: str, concurrency: int, num_prompts: int, max_tokens: int) -> dict:
    """`num_prompts` streamed requests from `concurrency` clients; latency and tokens/s."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(num_prompts):
        queue.put_nowait(PROMPTS[i % len(PROMPTS)])
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as http:

        async def worker() -> None:
            while not queue.empty():
                results.append(await _one(http, queue.get_nowait(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "num_prompts": num_prompts,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * _percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * _percentile(ttft, 99),
        "itl_p50_ms": 1e3 * _percentile(itl, 50),
        "itl_p99_ms": 1e3 * _percentile(itl, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--modes", nargs="+", default=["NONE", "FULL_DECODE_ONLY"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per level (default: max(16, 4 x concurrency))",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=4, help="requests before measuring")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `decodegraph serve` flag (repeatable), e.g. --device=cuda",
    )
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/)")
    args = parser.parse_args()

    rows: list[dict] = []
    for mode in args.modes:
        port = _free_port()
        started = time.perf_counter()
        proc = start_server(args.model, mode, port, args.server_arg)
        startup = time.perf_counter() - started
        base_url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(run_level(base_url, min(args.warmup, 4), args.warmup, 8))
            for c in args.concurrency:
                n = args.num_prompts or max(16, 4 * c)
                row = asyncio.run(run_level(base_url, c, n, args.max_tokens))
                row.update(mode=mode, startup_s=startup)
                rows.append(row)
                print(f"  {mode:<17} c={c:<3} {row['output_tokens_per_s']:8.1f} tok/s", flush=True)
            metrics = httpx.get(f"{base_url}/metrics").text
            graph_runs = [
                line
                for line in metrics.splitlines()
                if line.startswith("decodegraph:graph_runs_total{")
            ]
            for row in rows:
                if row["mode"] == mode:
                    row["graph_runs"] = graph_runs
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["mode"] == "NONE"}
    header = (
        f"{'mode':<17} {'conc':>4} {'tok/s':>9} {'vs NONE':>7} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = (
            r["output_tokens_per_s"] / base[r["concurrency"]]
            if r["concurrency"] in base
            else float("nan")
        )
        print(
            f"{r['mode']:<17} {r['concurrency']:>4} {r['output_tokens_per_s']:>9.1f} "
            f"{ratio:>6.2f}x {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} "
            f"{r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>8.2f}"
        )

    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "bench_serve.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "model": args.model,
                "max_tokens": args.max_tokens,
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"saved {out}")


if __name__ == "__main__":
    main()
