"""Start-up time: from a fresh process to the first generated token, cold and warm.

Each run is a fresh Python process that builds an engine and generates one token. A
cold run has an empty Inductor cache directory (TORCHINDUCTOR_CACHE_DIR, a new temporary
directory per round), a warm run the directory its cold run filled. The phases are the
engine's own ("Engine ready in ... (load, profile, KV cache, capture)" in its start-up
log line); "import" is importing decodegraph, "engine" building the engine (the phases,
the tokenizer and the rest), "first token" the generate call after start-up, and "ready"
the time from launching the process to its first token (the total less the interpreter's
exit). Rounds alternate cold and warm; the table shows medians.

    .venv/bin/python benchmarks/bench_startup.py                     # stories260K, demo
    .venv/bin/python benchmarks/bench_startup.py --cases qwen2.5-0.5b-shape --rounds 1

Cases: `stories260K` (the bundled model, default graph mode, LLM class defaults),
`demo` (`decodegraph generate --max-tokens 61`, as `make demo`: wall time of the whole
command, and when its first token came is not separable, so phases are the engine's),
`qwen2.5-0.5b-shape` (Qwen2.5-0.5B's config, fp32, random weights: load_format dummy),
`qwen2.5-0.5b-checkpoint` (the same shapes read from a saved fp32 safetensors
checkpoint with a tokenizer, as the issue measured it: bench_decode.py's mid-size
checkpoint, written once under `--mid-dir`; after its first read it is in the page
cache). Results go to benchmarks/results/bench_startup.json.

`--tree NAME=DIR` (repeatable) also starts from another source tree, e.g. an exported
copy of the commit before a change, in the same rounds. Each tree builds its CPU
operators once before the rounds, under an XDG_CACHE_HOME of its own: that build
directory is keyed by source, flags and CPU but not by checkout, so trees sharing one
would rebuild each other's operators in the timed runs. "cpu" is the CPU seconds of the
run and of the compilers it started, which a shared machine's load moves less than the
wall time.

`--batch-after 4 128` also times, after the first token, a batch of 4 greedy requests
of 128 tokens and then the same batch again: with decode sizes made on demand, the
first such batch sets the 4-request graph building and runs beside its build. The run
then waits for that build (untimed), so that its warm run starts from a cache holding
it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "bench_startup.json"
READY = re.compile(r"Engine ready in ([\d.]+) s \(([^)]*)\)")

# Qwen2.5-0.5B's shapes (its config.json, less the tokenizer's files).
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}

_CHILD = """
import json, logging, os, sys, time
t0 = time.perf_counter()
logging.basicConfig(level="INFO", format="%(name)s: %(message)s")
from decodegraph.entrypoints.llm import LLM
from decodegraph.sampling_params import SamplingParams
t1 = time.perf_counter()
llm = LLM(**json.loads(sys.argv[1]))
t2 = time.perf_counter()
llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
launched = float(os.environ["BENCH_LAUNCHED_AT"])
result = {
    "import": t1 - t0, "engine": t2 - t1, "first token": t3 - t2, "ready": time.time() - launched
}
if os.environ.get("BENCH_BATCH"):
    n, tokens = (int(x) for x in os.environ["BENCH_BATCH"].split(","))
    prompts = [{"prompt_token_ids": [1, 10 + i]} for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for name in ("batch", "batch again"):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        result[name] = time.perf_counter() - t
    # Untimed: whatever graph the batch set building is made, so that a warm run's
    # cache holds what its cold run would have left after running a while.
    llm.llm_engine.engine_core.wait_for_background_graph()
print("RESULT " + json.dumps(result))
"""


def _case_command(case: str, model_dir: Path | None, checkpoint: Path | None) -> list[str]:
    python = sys.executable
    if case == "demo":
        return [python, "-m", "decodegraph", "generate", "--max-tokens", "61"]
    if case == "stories260K":
        kwargs: dict[str, object] = {"model": "stories260K"}
    elif case == "qwen2.5-0.5b-checkpoint":
        kwargs = {"model": str(checkpoint), "dtype": "float32", "kv_cache_memory_bytes": 3 << 30}
    else:
        kwargs = {
            "model": str(model_dir),
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "dtype": "float32",
            # As in the measurement: a 3 GiB cache (a fixed size, not a share of
            # whatever memory this machine has free).
            "kv_cache_memory_bytes": 3 << 30,
        }
    return [python, "-c", _CHILD, json.dumps(kwargs)]


def _mid_checkpoint(mid_dir: Path) -> Path:
    """bench_decode.py's fp32 mid-size checkpoint (its sibling module writes it once)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import peers

    return peers.make_mid_checkpoint(mid_dir / "qwen2.5-0.5b-float32", torch.float32)


def _run(
    command: list[str], cache_dir: str, tree: Path, xdg: Path, batch: list[int] | None
) -> dict[str, float]:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": cache_dir,
        "PYTHONPATH": str(tree),
        "XDG_CACHE_HOME": str(xdg),
    }
    if batch:
        env["BENCH_BATCH"] = f"{batch[0]},{batch[1]}"
    start = time.perf_counter()
    cpu_before = _children_cpu()
    env["BENCH_LAUNCHED_AT"] = repr(time.time())
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{command[:4]} failed:\n{proc.stderr[-3000:]}")
    # CPU seconds of the process and the compilers it ran: on a shared machine they
    # move less with other sessions' load than the wall time does.
    out: dict[str, float] = {"total": wall, "cpu": _children_cpu() - cpu_before}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out.update(json.loads(line[len("RESULT ") :]))
    ready = READY.search(proc.stderr)
    if ready:
        for part in ready.group(2).split(", "):
            name, seconds, _ = part.rsplit(" ", 2)
            out[name] = float(seconds)
    return out


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _build_native(tree: Path, xdg: Path) -> None:
    """Build a tree's CPU operators once, outside the timed runs (each tree has its own
    build directory: see XDG_CACHE_HOME in the module docstring)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "XDG_CACHE_HOME": str(xdg)}
    code = "from decodegraph import native; native.load_cpu_ops()"
    subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True)


def _cpu() -> dict[str, str]:
    info = {"machine": platform.machine(), "cores": str(os.cpu_count())}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return info
    for line in text.splitlines():
        if line.startswith("Model name:"):
            info["model"] = line.split(":", 1)[1].strip()
        if line.startswith("Flags:"):
            flags = line.split()
            isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
            info["isa"] = isa
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["stories260K", "demo"],
        choices=["stories260K", "demo", "qwen2.5-0.5b-shape", "qwen2.5-0.5b-checkpoint"],
    )
    parser.add_argument(
        "--mid-dir",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "decodegraph_mid",
        help="where qwen2.5-0.5b-checkpoint's checkpoint is (written there if absent); "
        "bench_decode.py's default",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also start from another source tree (e.g. the commit before a change), "
        "interleaved with this one in every round",
    )
    parser.add_argument(
        "--batch-after",
        nargs=2,
        type=int,
        metavar=("REQUESTS", "TOKENS"),
        help="after the first token, time a batch of REQUESTS greedy requests of TOKENS "
        "tokens each, then the same batch again (columns 'batch', 'batch again'; not in "
        "the demo case): what a batch that needs a graph not made at start-up waits",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.batch_after and min(args.batch_after) < 1:
        parser.error("--batch-after: REQUESTS and TOKENS must be at least 1")

    trees = {"current": REPO}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        trees[name] = Path(path).resolve()
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        model_dir = Path(tmp) / "qwen2.5-0.5b-shape"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(QWEN2_5_0_5B))
        checkpoint = None
        if "qwen2.5-0.5b-checkpoint" in args.cases:
            checkpoint = _mid_checkpoint(args.mid_dir)
        xdg = {name: Path(tmp) / f"xdg_{name}" for name in trees}
        for name, tree in trees.items():
            _build_native(tree, xdg[name])
        for r in range(args.rounds):
            for case in args.cases:
                for name, tree in trees.items():
                    cache = tempfile.mkdtemp(prefix=f"inductor_{r}_", dir=tmp)
                    label = case if len(trees) == 1 else f"{case} [{name}]"
                    runs = results.setdefault(label, {"cold": [], "warm": []})
                    command = _case_command(case, model_dir, checkpoint)
                    for kind in ("cold", "warm"):
                        batch = args.batch_after if case != "demo" else None
                        runs[kind].append(_run(command, cache, tree, xdg[name], batch))
                        row = runs[kind][-1]
                        print(
                            f"round {r + 1} {label} {kind}: {row['total']:.1f} s "
                            f"({row['cpu']:.1f} CPU s)",
                            flush=True,
                        )

    columns = [
        "total", "ready", "cpu", "import", "engine", "load", "profile", "KV cache", "capture",
        "first token", "batch", "batch again",
    ]  # fmt: skip
    print(f"\nmedians of {args.rounds} round(s), seconds (cpu: CPU seconds, compilers included)")
    width = max(22, *(len(label) + 2 for label in results))
    print(f"{'case':<{width}}{'cache':<7}" + "".join(f"{c:>12}" for c in columns))
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for case, runs in results.items():
        for kind, rows in runs.items():
            med = {c: statistics.median(row[c] for row in rows) for c in columns if c in rows[0]}
            summary.setdefault(case, {})[kind] = med
            cells = "".join(f"{med[c]:>12.2f}" if c in med else f"{'-':>12}" for c in columns)
            print(f"{case:<{width}}{kind:<7}{cells}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "cpu": _cpu(),
                "rounds": args.rounds,
                "median_seconds": summary,
                "runs": results,
            },
            indent=2,
        )
    )
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
