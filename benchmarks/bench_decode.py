"""Decode speed per graph mode, beside CTranslate2, llama2.c and transformers, in one run.

Every side runs the same workloads at the same intra-op thread count (--threads, 1 by
default), in rounds that run every side once each, so that a noisy phase of this shared
machine hits every side of a ratio:
- batch 1: one request generates --tokens tokens from BOS (EOS ignored); tokens/s is one
  over the median decode-step time per token for the engine, llama2.c's own "achieved tok/s" (from
  its second token), tokens over wall time for CTranslate2 and transformers;
- batched: --num-requests requests x --batch-tokens tokens, tokens over wall time (not
  llama2.c, which has no batching), after one untimed run per side. Every side returns
  token ids, none decodes them into text (the engine with `detokenize=False`, as vLLM's
  `--disable-detokenize`; CTranslate2 and transformers return ids).
Per engine mode (and --num-scheduler-steps setting): medians over rounds, and the median
over rounds of its tokens/s over each peer's in the same round; the engine's own work per
token at batch 1 (median step time per token minus median forward); start-up seconds,
capture seconds and graph count.

Every row also shows the fraction of the memory-bandwidth floor it reaches: the bytes a
decode step must read (every weight once, the LM head rather than the embedding, and each
sequence's KV cache at its mean length) over a streaming bandwidth measured here at the
same thread count (the fastest of a large tensor's sum, its copy and BLAS's matrix-vector
product over it), at the start and after every batch-1 round (median), so that the floor
sees the same load as the sides.

--mid-size adds a Qwen2.5-0.5B-shaped random checkpoint (written once under --mid-dir),
in fp32 and bf16, at batch 1 and --mid-batch: minutes per dtype on 2 cores.

Peers that are not installed or cannot be built are skipped with the reason printed.
Prints tables and saves JSON under benchmarks/results/.

    python benchmarks/bench_decode.py                       # every mode, every peer
    python benchmarks/bench_decode.py --modes NONE FULL_DECODE_ONLY --peers ctranslate2
    python benchmarks/bench_decode.py --modes FULL_DECODE_ONLY --mid-size --skip-throughput
    python benchmarks/bench_decode.py --modes FULL_DECODE_ONLY --num-scheduler-steps 1 8
    python benchmarks/bench_decode.py --modes FULL_DECODE_ONLY --num-scheduler-steps 1 8 \\
        --multi-step-graphs         # x8 with a graph per step and with one graph in all

On an AVX-512 machine, every side can be held to AVX2 code (what an AVX2-only CPU runs,
on this machine's caches and memory): torch's kernels and Inductor's generated code
(ATEN_CPU_CAPABILITY), MKL, oneDNN, our operators (DECODEGRAPH_CPU_ISA), CTranslate2
(CT2_FORCE_CPU_ISA) and llama2.c (--llama2c-march):

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
    DECODEGRAPH_CPU_ISA=avx2 CT2_FORCE_CPU_ISA=AVX2 \\
        python benchmarks/bench_decode.py --llama2c-march x86-64-v3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402 (the benchmark's sibling module)

from decodegraph import LLM, SamplingParams  # noqa: E402
from decodegraph.benchmarks.common import GRAPH_MODES, write_json  # noqa: E402
from decodegraph.models.bundled import bundled_model_path  # noqa: E402
from decodegraph.sampling_params import RequestOutputKind  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = bundled_model_path("stories260K")
PEERS = ["ctranslate2", "llama2.c", "transformers"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Side(Protocol):
    name: str

    def batch1(self, tokens: int) -> float: ...
    def batched(self, prompts: list[list[int]], tokens: int) -> float | None: ...


class Job(NamedTuple):
    """One model's rows: its checkpoint, the engine modes and settings, the workload."""

    title: str
    path: Path
    dtype: torch.dtype
    modes: list[str]
    engine_kwargs: dict[str, Any]  # EngineArgs fields, and capture_sizes
    workload: dict[str, int]  # bench_model's keyword arguments


def _decode_steps(llm: LLM, tokens: int) -> tuple[list[float], list[float]]:
    """One batch-1 request of `tokens` tokens from BOS, stepped by hand: the seconds per
    token of each decode step (a multi-step batch's seconds over its tokens) and of
    each model forward (the prefill step dropped)."""
    engine = llm.llm_engine
    runner = engine.runner
    graphs = runner.graph_runner
    forward_times: list[float] = []
    original, original_replay = runner._forward, graphs.replay

    def timed(step):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        out = original(step)
        forward_times.append(time.perf_counter() - start)
        return out

    def timed_replay(mode, key, metadata):  # noqa: ANN001, ANN202
        # A multi-step graph's replay is its batch's every forward: its time per step.
        if key.num_steps == 1:
            return original_replay(mode, key, metadata)
        start = time.perf_counter()
        out = original_replay(mode, key, metadata)
        forward_times.extend([(time.perf_counter() - start) / key.num_steps] * key.num_steps)
        return out

    runner._forward, graphs.replay = timed, timed_replay
    try:
        params = SamplingParams(
            temperature=0,
            max_tokens=tokens,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,  # as LLM.generate runs it
        )
        engine.add_request("decode", {"prompt_token_ids": [1]}, params)
        step_times = []
        while engine.has_unfinished_requests():
            # Steps dispatched: one per token of the one request (several for a
            # multi-step batch, whether it replays a graph per step or one in all).
            dispatched = sum(graphs.mode_counts.values())
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            step_times.append(elapsed / max(1, sum(graphs.mode_counts.values()) - dispatched))
    finally:
        del runner._forward, graphs.replay  # the class's methods again
    return step_times[1:], forward_times[1:]


class EngineSide:
    """decodegraph in one graph mode; keeps every batch-1 step and forward time."""

    def __init__(self, model: str, mode: str, use_inductor: bool, **engine_kwargs: Any) -> None:
        steps = engine_kwargs.get("num_scheduler_steps", 1)
        multi_step_graphs = engine_kwargs.pop("multi_step_graphs", False)
        # None: the default (one rank: made in the background once a batch needs it).
        dynamic = engine_kwargs.pop("dynamic_decode_graph", None)
        self.name = mode if steps == 1 else f"{mode} x{steps}"
        if multi_step_graphs:
            self.name += " graph"
        if dynamic is not None:
            self.name += " dynamic" if dynamic else " no dynamic"
        start = time.perf_counter()
        compilation = {
            "cudagraph_mode": mode,
            "use_inductor": use_inductor,
            "multi_step_graphs": multi_step_graphs,
            "dynamic_decode_graph": dynamic,
        }
        sizes = engine_kwargs.pop("capture_sizes", None)
        if sizes:
            compilation["cudagraph_capture_sizes"] = sizes
        self.llm = LLM(model, compilation_config=compilation, **engine_kwargs)
        graphs = self.llm.llm_engine.runner.graph_runner
        self.info = {
            "resolved_mode": graphs.mode.name,
            "startup_s": time.perf_counter() - start,
            "capture_s": graphs.stats.seconds,
            "num_graphs": graphs.stats.num_graphs,
        }
        self.steps: list[float] = []
        self.forwards: list[float] = []

    def settle(self) -> None:
        """After the untimed run: wait for the graphs that run set building in the
        background (the dynamic decode graph, decode sizes made on demand; their seconds
        go into the row), so the timed runs measure the engine as it serves from then on."""
        start = time.perf_counter()
        self.llm.llm_engine.engine_core.wait_for_background_graph()
        stats = self.llm.llm_engine.runner.graph_runner.stats
        if stats.dynamic_decode_build:
            self.info["dynamic_decode_build"] = stats.dynamic_decode_build
            self.info["dynamic_decode_build_s"] = stats.dynamic_decode_build_seconds
        if stats.on_demand_builds:
            self.info["on_demand_builds"] = {str(k): v for k, v in stats.on_demand_builds.items()}
        if stats.dynamic_decode_build or stats.on_demand_builds:
            self.info["settle_wait_s"] = time.perf_counter() - start

    def batch1(self, tokens: int) -> float:
        steps, forwards = _decode_steps(self.llm, tokens)
        self.steps += steps
        self.forwards += forwards
        return 1.0 / statistics.median(steps)

    def batched(self, prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def batch_prompts(num_requests: int) -> list[list[int]]:
    """The batched workload's prompts (every side): BOS and one token, ids below 256 so
    that they exist in every benchmark model's vocabulary."""
    return [[1, (7 * i) % 200 + 30] for i in range(num_requests)]


def build_peers(
    names: list[str],
    model_dir: Path,
    dtype: torch.dtype,
    threads: int,
    work: Path,
    llama2c_march: str = "native",
) -> tuple[list[Side], dict[str, str]]:
    """The peers that run here, and for each one that does not, why."""
    sides: list[Side] = []
    skipped: dict[str, str] = {}
    for name in names:
        try:
            if name == "ctranslate2":
                sides.append(peers.CTranslate2Side(model_dir, dtype, threads, work))
            elif name == "llama2.c":
                if model_dir.resolve() != DEFAULT_MODEL.resolve():
                    raise peers.PeerUnavailable("only stories260K exists in llama2.c's format")
                sides.append(peers.Llama2cSide(work, march=llama2c_march))
            elif name == "transformers":
                sides.append(peers.TransformersSide(model_dir, dtype))
            else:
                raise ValueError(f"unknown peer {name!r} (one of {', '.join(PEERS)})")
        except peers.PeerUnavailable as e:
            skipped[name] = str(e)
            print(f"skipping {name}: {e}")
    return sides, skipped


def _ratios(mine: list[float], theirs: list[float | None]) -> float | None:
    pairs = [(a, b) for a, b in zip(mine, theirs, strict=True) if b]
    return statistics.median(a / b for a, b in pairs) if pairs else None


def bench_model(
    model_dir: Path,
    dtype: torch.dtype,
    engines: list[EngineSide],
    others: list[Side],
    *,
    tokens: int,
    repeats: int,
    num_requests: int,
    batch_tokens: int,
    throughput_repeats: int,
    bandwidth_gbs: float,
) -> dict[str, dict[str, Any]]:
    """Interleaved rounds over every side; one result row per side, and the floor."""
    sides: list[Side] = [*engines, *others]
    b1: dict[str, list[float]] = {s.name: [] for s in sides}
    bandwidths = [bandwidth_gbs]
    for _ in range(repeats):
        for s in sides:
            b1[s.name].append(s.batch1(tokens))
        # The floor is measured in every round too, under that round's load.
        bandwidths.append(peers.measure_bandwidth(mib=256, repeats=3).floor_gbs)
    bat: dict[str, list[float | None]] = {s.name: [] for s in sides}
    prompts = batch_prompts(num_requests)
    if throughput_repeats:
        # One untimed run per side first: a side's first batched run also pays for the
        # first touch of its caches' memory (on these VMs a fresh page costs far more
        # than its use; docs/performance.md, 2026-12-03 19:30 UTC).
        for s in sides:
            s.batched(prompts, batch_tokens)
        for s in sides:
            if hasattr(s, "settle"):
                s.settle()
    for _ in range(throughput_repeats):
        for s in sides:
            bat[s.name].append(s.batched(prompts, batch_tokens))
    need = peers.decode_bytes(model_dir, dtype)
    bandwidth_gbs = statistics.median(bandwidths)
    floor_b1 = need.floor_tokens_per_s(bandwidth_gbs, 1, (tokens + 1) / 2)
    floor_bat = need.floor_tokens_per_s(bandwidth_gbs, num_requests, 2 + batch_tokens / 2)
    rows: dict[str, dict[str, Any]] = {}
    for s in sides:
        row: dict[str, Any] = dict(getattr(s, "info", {}))
        row["batch1_tokens_per_s"] = statistics.median(b1[s.name])
        row["batch1_rounds"] = b1[s.name]
        row["batch1_floor_fraction"] = row["batch1_tokens_per_s"] / floor_b1
        done = [r for r in bat[s.name] if r is not None]
        if done:
            row["batched_tokens_per_s"] = statistics.median(done)
            row["batched_rounds"] = done
            row["batched_floor_fraction"] = row["batched_tokens_per_s"] / floor_bat
        if isinstance(s, EngineSide):
            step, forward = statistics.median(s.steps), statistics.median(s.forwards)
            row.update(step_us=step * 1e6, forward_us=forward * 1e6)
            row["overhead_us"] = (step - forward) * 1e6
            s.steps, s.forwards = [], []
            for o in others:
                if (r := _ratios(b1[s.name], b1[o.name])) is not None:
                    row[f"batch1_x_{o.name}"] = r
                if done and (r := _ratios(done, bat[o.name])) is not None:
                    row[f"batched_x_{o.name}"] = r
        rows[s.name] = row
    rows["_floor"] = {
        "weight_bytes": need.weight_bytes,
        "kv_bytes_per_position": need.kv_bytes_per_position,
        "batch1_tokens_per_s": floor_b1,
        "batched_tokens_per_s": floor_bat,
        "bandwidth_gbs": bandwidth_gbs,
        "bandwidth_rounds_gbs": bandwidths,
    }
    return rows


def _rate(tokens_per_s: float) -> str:
    """Tokens/s with a decimal where the mid-size model's few tokens/s need one."""
    return f"{tokens_per_s:.1f}" if tokens_per_s < 100 else f"{tokens_per_s:.0f}"


def print_table(title: str, rows: dict[str, dict[str, Any]], peer_names: list[str]) -> None:
    nan = float("nan")
    floor = rows["_floor"]
    print(
        f"\n{title}: bandwidth {floor['bandwidth_gbs']:.1f} GB/s (median over rounds), "
        f"floor {floor['batch1_tokens_per_s']:.0f} tok/s at batch 1, "
        f"{floor['batched_tokens_per_s']:.0f} batched"
    )
    ratio_cols = [p for p in peer_names if p in rows]
    head = f"{'side':<20}{'b1 tok/s':>10}{'b1 floor':>9}{'batched':>10}{'floor':>7}"
    head += "".join(f"{'b1 x ' + p[:6]:>12}{'bat x ' + p[:6]:>13}" for p in ratio_cols)
    print(head + f"{'step us':>9}{'other us':>9}{'startup s':>10}")
    for name, row in rows.items():
        if name == "_floor":
            continue
        line = (
            f"{name:<20}{_rate(row['batch1_tokens_per_s']):>10}{row['batch1_floor_fraction']:>9.3f}"
            f"{_rate(row.get('batched_tokens_per_s', nan)):>10}"
            f"{row.get('batched_floor_fraction', nan):>7.3f}"
        )
        for p in ratio_cols:
            line += f"{row.get(f'batch1_x_{p}', nan):>12.2f}{row.get(f'batched_x_{p}', nan):>13.2f}"
        if "step_us" in row:
            line += f"{row['step_us']:>9.0f}{row['overhead_us']:>9.0f}{row['startup_s']:>10.1f}"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--modes", nargs="+", default=GRAPH_MODES)
    p.add_argument("--peers", nargs="*", default=PEERS, help=f"any of {', '.join(PEERS)}")
    p.add_argument("--tokens", type=int, default=256, help="batch-1 decode length")
    p.add_argument("--repeats", type=int, default=8, help="interleaved rounds")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=200)
    p.add_argument("--throughput-repeats", type=int, default=5, help="rounds (medians)")
    p.add_argument("--skip-hf", action="store_true", help="drop transformers from --peers")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--no-inductor", action="store_true", help="CPU graphs replay the raw trace")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads, every side")
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        nargs="+",
        default=[1],
        help="engine sides per mode, one per multi-step setting (a row each)",
    )
    p.add_argument(
        "--multi-step-graphs",
        action="store_true",
        help="for each --num-scheduler-steps above 1, a row more whose engine runs a "
        "greedy batch's steps as one graph (compilation_config multi_step_graphs)",
    )
    p.add_argument(
        "--dynamic-decode-graph",
        nargs="+",
        choices=["default", "off", "on"],
        default=["default"],
        help="engine sides per mode, one per setting of compilation_config "
        "dynamic_decode_graph (default: unset, the graph for uniform decode batches above "
        "the largest capture size made in the background once the untimed run needs it; "
        "on: made at start-up, the row's name ends in 'dynamic'; off: none, 'no dynamic')",
    )
    p.add_argument(
        "--llama2c-march",
        default="native",
        help="gcc -march for llama2.c (x86-64-v3: AVX2 code, to run beside the AVX2-only "
        "environment of the docstring)",
    )
    g = p.add_argument_group("mid-size model (Qwen2.5-0.5B-shaped, random weights)")
    g.add_argument("--mid-size", action="store_true", help="add its rows")
    g.add_argument("--mid-only", action="store_true", help="skip --model's rows")
    g.add_argument("--mid-dtypes", nargs="+", default=list(_DTYPES), choices=list(_DTYPES))
    g.add_argument("--mid-modes", nargs="+", default=None, help="default: --modes")
    g.add_argument("--mid-tokens", type=int, default=64, help="batch-1 decode length")
    g.add_argument("--mid-batch", type=int, default=32, help="batched requests")
    g.add_argument("--mid-batch-tokens", type=int, default=64)
    g.add_argument("--mid-repeats", type=int, default=3, help="rounds, both workloads")
    g.add_argument("--mid-capture-sizes", type=int, nargs="+", default=[1, 32])
    g.add_argument(
        "--mid-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "decodegraph_mid")
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_decode.json"))
    args = p.parse_args()
    os.environ["DECODEGRAPH_CPU_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    peer_names = [n for n in args.peers if not (args.skip_hf and n == "transformers")]
    work = peers.work_dir()

    bw = peers.measure_bandwidth()
    print(
        f"intra-op threads: {args.threads}; bandwidth: read {bw.read_gbs:.1f} GB/s, "
        f"copy {bw.copy_gbs:.1f} GB/s, GEMV {bw.gemv_gbs:.1f} GB/s (floor at {bw.floor_gbs:.1f})"
    )
    results: dict[str, Any] = {
        "threads": args.threads,
        "bandwidth_gbs": {
            "read": bw.read_gbs,
            "copy": bw.copy_gbs,
            "gemv": bw.gemv_gbs,
            "floor": bw.floor_gbs,
        },
        "models": {},
    }
    jobs: list[Job] = []
    if not args.mid_only:
        jobs.append(
            Job(
                Path(args.model).name,
                Path(args.model),
                torch.float32,
                args.modes,
                {},
                dict(
                    tokens=args.tokens,
                    repeats=args.repeats,
                    num_requests=args.num_requests,
                    batch_tokens=args.batch_tokens,
                    throughput_repeats=0 if args.skip_throughput else args.throughput_repeats,
                ),
            )
        )
    if args.mid_size or args.mid_only:
        for name in args.mid_dtypes:
            dtype = _DTYPES[name]
            path = Path(args.mid_dir) / f"qwen2.5-0.5b-{name}"
            print(f"mid-size checkpoint: {peers.make_mid_checkpoint(path, dtype)}")
            engine_kwargs = dict(
                dtype=name,
                max_model_len=max(args.mid_tokens, args.mid_batch_tokens) + 64,
                max_num_batched_tokens=256,
                kv_cache_memory_bytes=512 * 2**20,
                capture_sizes=args.mid_capture_sizes,
            )
            jobs.append(
                Job(
                    f"qwen2.5-0.5b-shape {name}",
                    path,
                    dtype,
                    args.mid_modes or args.modes,
                    engine_kwargs,
                    dict(
                        tokens=args.mid_tokens,
                        repeats=args.mid_repeats,
                        num_requests=args.mid_batch,
                        batch_tokens=args.mid_batch_tokens,
                        throughput_repeats=0 if args.skip_throughput else args.mid_repeats,
                    ),
                )
            )
    for title, path, dtype, modes, engine_kwargs, workload in jobs:
        # Every side is built before the first round, so that none gains from running
        # later (warm caches).
        settings = [(k, False) for k in dict.fromkeys(args.num_scheduler_steps)]
        if args.multi_step_graphs:
            settings += [(k, True) for k, _ in settings if k > 1]
        engines = [
            EngineSide(
                str(path),
                m,
                not args.no_inductor,
                num_scheduler_steps=k,
                multi_step_graphs=graph,
                dynamic_decode_graph={"default": None, "off": False, "on": True}[dynamic],
                **engine_kwargs,
            )
            for m in dict.fromkeys(modes)
            for k, graph in settings
            for dynamic in dict.fromkeys(args.dynamic_decode_graph)
        ]
        others, skipped = build_peers(
            peer_names, path, dtype, args.threads, work, args.llama2c_march
        )
        rows = bench_model(path, dtype, engines, others, bandwidth_gbs=bw.floor_gbs, **workload)
        for name, reason in skipped.items():
            rows.setdefault("_skipped", {})[name] = reason
        results["models"][title] = {"path": str(path), "dtype": str(dtype), "rows": rows}
        print_table(title, {k: v for k, v in rows.items() if k != "_skipped"}, peer_names)
        for side in others:
            if side.name == "ctranslate2":
                results["ctranslate2_version"] = side.version
        del engines, others
        gc.collect()
    print()
    write_json(args.out, "decode", results)
    print(json.dumps({"saved": args.out}))


if __name__ == "__main__":
    main()
