"""Server throughput measured by guidellm, against `LLM.generate` on the same workload.

Starts `decodegraph serve` on loopback (as benchmarks/bench_serve.py does, one graph
mode), drives it with guidellm's concurrent profile (`--concurrency` streams, synthetic
prompts of `--prompt-tokens` tokens, `--output-tokens` generated, EOS ignored: guidellm
asks for that) and, in this process, runs `LLM.generate` on the same model and mode:
batch 1 (one request at a time) as the ceiling of concurrency 1, every request at once
as the ceiling of the higher levels. Sampling is the server's default (guidellm sends
no temperature). The rounds alternate configurations and the medians count, so that a
machine shared with others slows every configuration alike.

`--server NAME=DIR` (repeatable) serves from another source tree as well, e.g. the
commit before a change, so that before and after are measured in the same rounds;
`--variant NAME=FLAGS` (repeatable) serves this tree with extra serve flags as well,
e.g. `--variant proc=--engine-core-process`.

guidellm is an optional benchmark dependency, run as a separate process (a client; its
own dependencies need not match ours): `python3 -m venv /tmp/guidellm-venv &&
/tmp/guidellm-venv/bin/pip install guidellm`, then `--guidellm
/tmp/guidellm-venv/bin/guidellm` (default: `guidellm` on PATH).

    python benchmarks/bench_serve_guidellm.py --guidellm /tmp/guidellm-venv/bin/guidellm

guidellm runs with one worker process (`--client-processes`; its default of ten takes a
machine's few cores from the server). Each server row also shows the server's CPU
seconds per output token (the server process and its children, such as the engine core's
process), which other sessions' load moves less than tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import ROOT, _free_port, start_server  # noqa: E402

from decodegraph.benchmarks.common import print_table, random_prompts, write_json  # noqa: E402
from decodegraph.models.bundled import DEFAULT_MODEL, bundled_model_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--mode", default="FULL_DECODE_ONLY", help="cudagraph_mode")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument(
        "--requests-per-stream", type=int, default=16, help="guidellm requests per stream"
    )
    parser.add_argument("--min-requests", type=int, default=32, help="per guidellm run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also serve from the source tree DIR (repeatable); this tree is 'current'",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also serve this tree with these extra serve flags (repeatable)",
    )
    parser.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="guidellm's worker processes (GUIDELLM__MAX_WORKER_PROCESSES; its own default "
        "is 10, which on a machine of few cores takes them from the server)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_serve_guidellm.json"))
    args = parser.parse_args()
    guidellm = shutil.which(args.guidellm)
    if guidellm is None:
        raise SystemExit(f"--guidellm: {args.guidellm!r} not found (see this script's doc)")
    tokenizer_dir = bundled_model_path(args.model) or Path(args.model).expanduser()

    sources = {"current": str(ROOT)}
    flags: dict[str, list[str]] = {"current": []}
    for spec in args.server:
        name, _, src = spec.partition("=")
        sources[name], flags[name] = str(Path(src).resolve()), []
    for spec in args.variant:
        name, _, extra = spec.partition("=")
        sources[name], flags[name] = str(ROOT), extra.split()
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for name, src in sources.items():
            port = _free_port()
            env = {**os.environ, "PYTHONPATH": src}
            extra = [*args.server_arg, *flags[name]]
            servers[name] = (start_server(args.model, args.mode, port, extra, env=env), port)
        llm = _offline_engine(args)
        for port in (p for _, p in servers.values()):  # one-off costs, untimed
            _guidellm(guidellm, args, tokenizer_dir, port, max(args.concurrency), 64)
        _offline(llm, args, 8, 8)

        runs: dict[str, list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            for name, (proc, port) in servers.items():
                for c in args.concurrency:
                    n = max(args.min_requests, c * args.requests_per_stream)
                    cpu_before = _cpu_seconds(proc.pid)
                    run = _guidellm(guidellm, args, tokenizer_dir, port, c, n)
                    tokens = run["output_tokens_per_request"] * n
                    run["server_cpu_us_per_token"] = (
                        (_cpu_seconds(proc.pid) - cpu_before) / tokens * 1e6
                    )
                    runs.setdefault(f"{name} c={c}", []).append(run)
                    print(
                        f"round {r} {name} c={c}: {run['output_tok_s']:.0f} tok/s, "
                        f"server {run['server_cpu_us_per_token']:.0f} CPU µs/token",
                        flush=True,
                    )
            for batch in sorted({1, max(args.concurrency)}):
                n = args.min_requests if batch == 1 else batch * 4
                for name, delta in (("offline", False), ("engine DELTA", True)):
                    run = _offline(llm, args, batch, n, delta)
                    runs.setdefault(f"{name} b={batch}", []).append(run)
                    print(f"round {r} {name} b={batch}: {run['output_tok_s']:.0f} tok/s")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)

    medians = {k: statistics.median(x["output_tok_s"] for x in v) for k, v in runs.items()}
    rows = []
    for name in ("offline", "engine DELTA"):
        for b in sorted({1, max(args.concurrency)}):
            rows.append([name, f"b={b}", medians[f"{name} b={b}"], "", "", "", ""])
    for name in servers:
        for c in args.concurrency:
            ceiling = medians[f"offline b={1 if c == 1 else max(args.concurrency)}"]
            key = f"{name} c={c}"
            itl = statistics.median(x["itl_ms_p50"] for x in runs[key])
            cpu = statistics.median(x["server_cpu_us_per_token"] for x in runs[key])
            rows.append([name, c, medians[key], ceiling, medians[key] / ceiling, itl, cpu])
    print_table(
        ["server", "conc", "tok/s", "offline tok/s", "x offline", "ITL p50 ms", "CPU µs/tok"],
        rows,
    )
    write_json(
        args.out,
        "serve-guidellm",
        {
            "model": args.model,
            "mode": args.mode,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "servers": {name: [src, *flags[name]] for name, src in sources.items()},
            "medians_output_tok_s": medians,
            "runs": runs,
        },
    )


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of a server and its live children (the engine core's process and its
    workers): its cost per token, which a shared machine's load moves less than tok/s."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _guidellm(
    exe: str, args: argparse.Namespace, tokenizer_dir: Path, port: int, streams: int, count: int
) -> dict[str, Any]:
    """One guidellm run at `streams` concurrent streams and `count` requests."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "guidellm.json"
        cmd = [exe, "run",
               "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},"
               "request_format=/v1/completions,http2=false",
               "--profile", f"kind=concurrent,streams={streams}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
               f"output_tokens={args.output_tokens}",
               "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
               "--constraint", f"kind=max_requests,count={count}",
               "--output", f"kind=json,path={out}", "--disable-console"]  # fmt: skip
        env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": str(args.client_processes)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"guidellm failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
        bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    if totals["successful"] != count:
        raise RuntimeError(f"guidellm: {totals} of {count} requests")
    return {
        "streams": streams,
        "requests": count,
        "duration_s": bench["duration"],
        "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
        "output_tokens_per_request": m["output_token_count"]["successful"]["mean"],
        "ttft_ms_p50": m["time_to_first_token_ms"]["successful"]["median"],
        "itl_ms_p50": m["inter_token_latency_ms"]["successful"]["median"],
    }


def _offline_engine(args: argparse.Namespace) -> Any:
    from decodegraph.entrypoints.llm import LLM

    return LLM(args.model, compilation_config={"cudagraph_mode": args.mode})


def _offline(
    llm: Any, args: argparse.Namespace, batch: int, count: int, delta: bool = False
) -> dict[str, Any]:
    """`LLM.generate` of `count` requests, `batch` at a time, at the server's default
    sampling. With `delta`, the same engine steps DELTA requests itself (text decoded
    and an output built every step, as for a stream, but no server): what the engine
    could reach in a process of its own, before the cost of moving its outputs out."""
    from decodegraph.sampling_params import RequestOutputKind, SamplingParams

    vocab = len(llm.get_tokenizer())
    prompts = [
        {"prompt_token_ids": p} for p in random_prompts(count, args.prompt_tokens, vocab, seed=0)
    ]
    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True, output_kind=kind)
    engine = llm.llm_engine
    start = time.perf_counter()
    for i in range(0, count, batch):
        if not delta:
            llm.generate(prompts[i : i + batch], params, use_tqdm=False)
            continue
        for j, prompt in enumerate(prompts[i : i + batch]):
            engine.add_request(f"delta-{i + j}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    seconds = time.perf_counter() - start
    return {
        "delta": delta,
        "batch": batch,
        "requests": count,
        "duration_s": seconds,
        "output_tok_s": count * args.output_tokens / seconds,
    }


if __name__ == "__main__":
    main()
