"""`decodegraph bench`: vLLM's benchmark subcommands, with its flag names.

- `latency`: one batch end to end, per graph mode and batch size (`latency.py`);
- `throughput`: many requests offline, per graph mode (`throughput.py`);
- `serve`: a running server under load, per request rate (`serve.py`).

Each prints a table, writes JSON with `--output-json FILE` (the machine's CPU model and
vector ISA included) and draws its figure with `--plot FILE.png` (`plot.py`, matplotlib).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

COMMANDS = {
    "latency": "latency of one batch, end to end, per graph mode and batch size",
    "throughput": "offline throughput of many requests, per graph mode",
    "serve": "latency and throughput of a running OpenAI-compatible server",
}


def add_bench_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """`decodegraph bench {latency,throughput,serve}`."""
    bench = subparsers.add_parser("bench", help="benchmarks (as `vllm bench`)")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"decodegraph.benchmarks.{name}")
        parser = commands.add_parser(name, help=help_text, description=module.__doc__)
        module.add_cli_args(parser)
        parser.set_defaults(func=_command(module.run))


def _command(run: Callable[[argparse.Namespace], object]) -> Callable[[argparse.Namespace], int]:
    """A CLI function: run the benchmark (it prints and writes its results), exit 0."""

    def command(args: argparse.Namespace) -> int:
        run(args)
        return 0

    return command
