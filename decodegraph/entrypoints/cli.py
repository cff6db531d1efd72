"""`decodegraph` command line: generate, graphs, bench, serve (vLLM-style flags)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from decodegraph.gc_utils import collector_paused

with collector_paused():  # torch and the engine's arguments (gc_utils)
    from decodegraph.config import CompilationConfig
    from decodegraph.engine.arg_utils import EngineArgs, UsageContext

logger = logging.getLogger("decodegraph")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def generate_engine_args(args: argparse.Namespace, num_prompts: int) -> EngineArgs:
    """The engine arguments of `generate`: its batch never holds more than its prompts
    (one sequence each), so max_num_seqs is capped there, and with it the graphs
    captured at start-up: none is compiled for a batch the run cannot reach. The
    largest reachable batch gets its own graph (the default sizes up to it, and it)."""
    engine_args = EngineArgs.from_cli_args(args)
    reachable = max(1, min(engine_args.max_num_seqs, num_prompts))
    engine_args.max_num_seqs = reachable
    cc = CompilationConfig.from_any(engine_args.compilation_config)
    if cc.cudagraph_capture_sizes is None:
        cc.max_cudagraph_capture_size = min(cc.max_cudagraph_capture_size or reachable, reachable)
    engine_args.compilation_config = cc
    return engine_args


def _generate(args: argparse.Namespace) -> int:
    with collector_paused():  # the engine and transformers' configurations (gc_utils)
        from decodegraph.engine.llm_engine import LLMEngine
        from decodegraph.models.presets import is_preset
        from decodegraph.sampling_params import SamplingParams

    prompts = args.prompt or [""]
    engine_args = generate_engine_args(args, len(prompts))
    if engine_args.load_format == "dummy" or is_preset(engine_args.model):
        print(
            "NOTE: random (dummy) weights: the generated text is noise; this run shows the "
            "engine working, not a model.",
            file=sys.stderr,
        )
    engine = LLMEngine.from_engine_args(engine_args, UsageContext.LLM_CLASS)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
        stop=args.stop,
    )
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        # An empty prompt means: start from the BOS token alone.
        if prompt == "":
            bos = engine.tokenizer.bos_token_id if engine.tokenizer is not None else None
            item: object = {"prompt": "", "prompt_token_ids": [bos if bos is not None else 0]}
        else:
            item = prompt
        engine.add_request(str(i), item, params)
    outputs = {}
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    elapsed = time.perf_counter() - start
    for i, prompt in enumerate(prompts):
        out = outputs[str(i)]
        num_tokens += len(out.outputs[0].token_ids)
        shown = repr(prompt) if prompt else "(none: from the BOS token)"
        print(f"--- prompt {i}: {shown}\n{prompt}{out.outputs[0].text}\n")
    stats = engine.get_stats()
    steps = ", ".join(f"{mode} {n}" for mode, n in sorted(stats.graph_runs.items()))
    print(
        f"--- {num_tokens} tokens in {elapsed:.3f} s ({num_tokens / elapsed:,.0f} tokens/s); "
        f"graph mode {engine.engine_core.graph_mode.name}; steps by mode: {steps}"
    )
    return 0


def _dynamic_decode_line(report: dict) -> str:
    """The `graphs` report's dynamic decode graph: the requests it serves, or those it
    will once made in the background, or "-"."""
    if report["dynamic_decode_rows"]:
        return "{} to {} requests".format(*report["dynamic_decode_rows"])
    if report["dynamic_decode_planned_rows"]:
        return "{} to {} requests, made in the background when a batch first needs it ({})".format(
            *report["dynamic_decode_planned_rows"], report["dynamic_decode_build"]
        )
    return "-"


def _on_demand_line(report: dict) -> str:
    """The `graphs` report's decode sizes made on demand, each with how its build stands,
    or "-"."""
    builds = report["decode_sizes_on_demand"]
    if not builds:
        return "-"
    listed = ", ".join(f"{size} ({state})" for size, state in builds.items())
    return f"{listed}: made in the background when a batch first needs each"


def _graphs(args: argparse.Namespace) -> int:
    with collector_paused():  # the engine and transformers' configurations (gc_utils)
        from decodegraph.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args), UsageContext.LLM_CLASS)
    report = graphs_report(engine)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    rows = [
        ("model", f"{report['model']} on {report['platform']}"),
        (
            "attention",
            f"{report['attention_backend']} (graph support "
            f"{report['attention_cudagraph_support']})",
        ),
        ("requested mode", report["requested_mode"]),
        ("resolved mode", report["resolved_mode"]),
        ("why", "; ".join(report["resolution"]) or "as requested"),
        ("capture sizes", ", ".join(map(str, report["capture_sizes"])) or "-"),
        ("dynamic decode", _dynamic_decode_line(report)),
        ("sizes on demand", _on_demand_line(report)),
        (
            "graphs",
            f"{report['num_graphs']}"
            + "".join(f", {mode}: {n}" for mode, n in report["graphs_by_mode"].items()),
        ),
        (
            "capture",
            f"{report['capture_seconds']:.1f} s, {report['capture_memory_bytes'] / 2**20:.1f} MiB",
        ),
        (
            "start-up",
            ", ".join(f"{k} {v:.1f} s" for k, v in report["startup_seconds"].items()),
        ),
        (
            "KV cache",
            ", ".join(f"{name} {n} blocks" for name, n in report["kv_cache_groups"].items())
            + f" of {report['block_size']} tokens",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if report["keys"]:
        print()
        print(f"{'runtime mode':<14}{'batches':<9}{'graphs':>7}  capture sizes")
        for row in report["keys"]:
            print(
                f"{row['runtime_mode']:<14}{row['batches']:<9}{row['graphs']:>7}  "
                f"{', '.join(map(str, row['sizes']))}"
            )
    return 0


def graphs_report(engine: object) -> dict:
    """What `decodegraph graphs` prints, as a dict (its --json output)."""
    info, cs = engine.engine_core.graph_info, engine.engine_core.capture_stats
    keys = []
    for mode, descriptors in engine.engine_core.dispatcher.keys.items():
        if not descriptors:
            continue
        # A runtime mode's keys are all uniform decode keys or all mixed ones.
        keys.append(
            {
                "runtime_mode": mode.name,
                "batches": "decode" if descriptors[0].uniform else "mixed",
                "graphs": cs.by_mode.get(mode.name, 0),
                "sizes": sorted(d.num_tokens for d in descriptors),
            }
        )
    return {
        "model": engine.config.model_config.model,
        "platform": engine.platform.name,
        "attention_backend": info.attention_backend,
        "attention_cudagraph_support": info.attention_cudagraph_support,
        "requested_mode": (
            "NONE (enforce_eager)"
            if engine.config.enforce_eager
            else engine.config.compilation_config.cudagraph_mode.name
        ),
        "resolved_mode": info.mode.name,
        "resolution": info.reasons,
        "capture_sizes": engine.engine_core.dispatcher.capture_sizes,
        # Uniform decode batches of these many requests run the dynamic decode graph.
        "dynamic_decode_rows": engine.engine_core.dispatcher.dynamic_decode_rows,
        # Where it is made in the background: its rows, and how its build stands.
        "dynamic_decode_planned_rows": cs.dynamic_decode_planned_rows,
        "dynamic_decode_build": cs.dynamic_decode_build,
        # Decode sizes made on demand, in the background: size -> how its build stands.
        "decode_sizes_on_demand": dict(cs.on_demand_builds),
        "num_graphs": cs.num_graphs,
        "graphs_by_mode": cs.by_mode,
        "keys": keys,
        "capture_seconds": round(cs.seconds, 3),
        "capture_memory_bytes": cs.memory_bytes,
        "startup_seconds": {k: round(v, 3) for k, v in engine.engine_core.startup_seconds.items()},
        "kv_cache_blocks": engine.engine_core.num_blocks_per_group[0] - 1,
        # KV cache group name -> its usable blocks (a sliding-window group needs few).
        "kv_cache_groups": {
            g.name: n - 1
            for g, n in zip(
                engine.engine_core.kv_cache_groups,
                engine.engine_core.num_blocks_per_group,
                strict=True,
            )
        },
        "block_size": engine.config.cache_config.block_size,
        "tensor_parallel_size": len(engine.engine_core.ranks),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decodegraph", description="LLM inference whose decode step is one replayed graph"
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts (offline)")
    EngineArgs.add_cli_args(gen)
    gen.add_argument(
        "--prompt", action="append", default=None, help="prompt (repeatable; none = BOS only)"
    )
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)

    graphs = sub.add_parser(
        "graphs", help="start an engine and print its resolved graph mode and captured graphs"
    )
    EngineArgs.add_cli_args(graphs, model_positional=True)
    graphs.add_argument("--json", action="store_true", help="print the report as JSON")
    graphs.set_defaults(func=_graphs)

    from decodegraph.benchmarks import add_bench_subcommand

    add_bench_subcommand(sub)

    try:
        from decodegraph.entrypoints.openai.api_server import add_serve_subcommand
    except ImportError:  # the server's dependencies are optional for offline use
        add_serve_subcommand = None
    if add_serve_subcommand is not None:
        serve = add_serve_subcommand(sub)
        serve.add_argument(
            "--headless",
            action="store_true",
            help="run only this node's ranks (--node-rank > 0), connected to node 0's "
            "driver at --master-addr; no API server",
        )
        serve.set_defaults(func=_serve, serve_func=serve.get_default("func"))
    return parser


def _serve(args: argparse.Namespace) -> int | None:
    """`serve`: the API server, or with --headless this node's ranks until the driver
    on node 0 shuts them down."""
    if not args.headless:
        return args.serve_func(args)
    from decodegraph.executor.multiproc import run_headless

    config = EngineArgs.from_cli_args(args).create_engine_config(UsageContext.OPENAI_API_SERVER)
    if config.parallel_config.node_rank == 0:
        raise ValueError(
            "node_rank: --headless runs a node without the driver: give --node-rank 1 or more"
        )
    return run_headless(config)


def main(argv: list[str] | None = None) -> int:
    with collector_paused():  # the bench and serve commands' modules (gc_utils)
        parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
