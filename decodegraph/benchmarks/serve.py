"""`decodegraph bench serve`: latency and throughput of a running OpenAI-compatible server.

As vLLM's `vllm bench serve` with its random dataset: `--num-prompts` streamed
completions of `--random-input-len` random tokens and up to `--random-output-len`
generated tokens, sent at `--request-rate` requests/s (Poisson arrivals, `inf`: all at
once; several rates give a sweep), at most `--max-concurrency` in flight, after
`--num-warmups` untimed requests (as vLLM's: the first prompt, once, before the first
rate). Per rate: TTFT (request sent to first token), TPOT (per output token after the
first), ITL (between streamed tokens) and E2EL (the whole request), their mean, median
and `--metric-percentiles`, and request and token throughput. It talks to any server that
speaks `/v1/completions` with streaming, decodegraph's or vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from pathlib import Path
from typing import Any, NamedTuple

from decodegraph.benchmarks.common import finish, print_table, random_prompts, summary

METRICS = ("ttft", "tpot", "itl", "e2el")


class ServeTarget(NamedTuple):
    """The server a run talks to, as `prepare` finds it: one look-up serves many runs."""

    base_url: str  # no trailing slash
    model: str  # the served model name every request carries
    vocab_size: int  # random prompt ids are drawn below it


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serve")
    g.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions")
    g.add_argument("--model", default=None, help="served model name (default: the first listed)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="directory of the model's tokenizer.json, for the vocabulary random prompts are "
        "drawn from (default: the model, when it is a local directory or bundled)",
    )
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--random-input-len", type=int, default=32)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--request-rate", type=float, nargs="+", default=[math.inf])
    g.add_argument("--burstiness", type=float, default=1.0, help="1.0: Poisson arrivals")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="always generate the full length")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="untimed requests (the first prompt) before the first rate",
    )
    g.add_argument("--metric-percentiles", default="50,90,99")
    g.add_argument("--output-json", default=None, help="write the results to this JSON file")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="latency per request rate")


def prepare(args: argparse.Namespace) -> ServeTarget:
    """The server at `--base-url` (or `--host`/`--port`), its model (`--model` or the
    first listed) and the vocabulary size of `--tokenizer` (or the model's)."""
    import httpx

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    try:
        listed = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise ValueError(f"--base-url: no OpenAI-compatible server at {base_url} ({e})") from e
    model = args.model or listed[0]["id"]
    return ServeTarget(base_url, model, _vocab_size(args.tokenizer or model))


def run(args: argparse.Namespace, target: ServeTarget | None = None) -> dict[str, Any]:
    """Warm up, run every `--request-rate`, print the table and write the results;
    `target` is the server as `prepare(args)` found it (looked up here when not given)."""
    qs = tuple(int(q) for q in str(args.metric_percentiles).split(","))
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        raise ValueError("--num-prompts, --random-input-len, --random-output-len: at least 1")
    if args.num_warmups < 0:
        raise ValueError("--num-warmups: must be at least 0")
    target = target or prepare(args)
    prompts = random_prompts(
        args.num_prompts, args.random_input_len, target.vocab_size, seed=args.seed
    )
    warm_up(args, target)
    runs, rows = [], []
    for rate in args.request_rate:
        run_result = asyncio.run(_run_rate(args, target, prompts, rate, qs))
        runs.append(run_result)
        rows.append(
            [
                str(rate),
                run_result["completed"],
                run_result["failed"],
                run_result["request_throughput"],
                run_result["output_throughput"],
                run_result["ttft_ms"]["median"],
                run_result["ttft_ms"]["percentiles"][str(qs[-1])],
                run_result["itl_ms"]["median"],
                run_result["itl_ms"]["percentiles"][str(qs[-1])],
            ]
        )
    print_table(
        [
            "rate",
            "done",
            "failed",
            "req/s",
            "out tok/s",
            "TTFT p50",
            f"TTFT p{qs[-1]}",
            "ITL p50",
            f"ITL p{qs[-1]}",
        ],
        rows,
    )
    print("(latencies in ms)")
    return finish(
        args,
        "serve",
        {
            "base_url": target.base_url,
            "model": target.model,
            "num_prompts": args.num_prompts,
            "num_warmups": args.num_warmups,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "max_concurrency": args.max_concurrency,
            "metric_percentiles": list(qs),
            "runs": runs,
        },
    )


def warm_up(args: argparse.Namespace, target: ServeTarget) -> None:
    """`--num-warmups` requests of the run's first prompt, at most `--max-concurrency` at
    a time, their figures dropped: the first requests a server sees pay one-off costs."""
    if args.num_warmups < 1:
        return
    prompt = random_prompts(1, args.random_input_len, target.vocab_size, seed=args.seed)[0]
    outcome = asyncio.run(_run_rate(args, target, [prompt] * args.num_warmups, math.inf, (50,)))
    print(f"warm-up: {args.num_warmups} requests, {outcome['failed']} failed", flush=True)


def _vocab_size(source: str) -> int:
    """The vocabulary size of the tokenizer in `source` (a directory or a bundled
    model's name); without one, 256 (every byte-level vocabulary has that many)."""
    from decodegraph.models.bundled import bundled_model_path

    path = bundled_model_path(source) or Path(source).expanduser()
    file = path / "tokenizer.json"
    if not file.is_file():
        print(f"no tokenizer.json in {source!r}: random prompts use token ids below 256")
        return 256
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file)).get_vocab_size()


async def _run_rate(
    args: argparse.Namespace,
    target: ServeTarget,
    prompts: list[list[int]],
    rate: float,
    qs: tuple[int, ...],
) -> dict[str, Any]:
    import httpx

    rng = random.Random(args.seed)
    limit = args.max_concurrency or len(prompts)
    semaphore = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(None, connect=30)
    http_limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(
        base_url=target.base_url, timeout=timeout, limits=http_limits
    ) as http:

        async def one(prompt: list[int]) -> dict[str, Any]:
            async with semaphore:
                return await _request(http, args, target.model, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if math.isfinite(rate):
                # Gamma-distributed gaps of mean 1/rate; burstiness 1 is a Poisson process.
                await asyncio.sleep(rng.gammavariate(args.burstiness, 1 / (rate * args.burstiness)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    done = [o for o in outcomes if o["error"] is None]
    errors = sorted({o["error"] for o in outcomes if o["error"] is not None})
    output_tokens = sum(o["output_tokens"] for o in done)
    prompt_tokens = sum(o["prompt_tokens"] for o in done)
    result: dict[str, Any] = {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "duration": duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": errors[:5],
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
    }
    for metric in METRICS:
        values = [1e3 * v for o in done for v in o[metric]]
        result[f"{metric}_ms"] = summary(values, qs)
    return result


async def _request(http: Any, args: argparse.Namespace, model: str, prompt: list[int]) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.random_output_len,
        "temperature": 0.0,
        "ignore_eos": args.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    outcome: dict[str, Any] = {"error": None, "output_tokens": 0, "prompt_tokens": len(prompt)}
    times: list[float] = []
    sent = time.perf_counter()
    try:
        async with http.stream("POST", args.endpoint, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    outcome["output_tokens"] = chunk["usage"]["completion_tokens"]
                    outcome["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        outcome["error"] = f"{type(e).__name__}: {e}"
        return outcome
    end = time.perf_counter()
    n = outcome["output_tokens"]
    outcome["ttft"] = [times[0] - sent] if times else []
    outcome["itl"] = [b - a for a, b in zip(times, times[1:], strict=False)]
    outcome["tpot"] = [(end - times[0]) / (n - 1)] if times and n > 1 else []
    outcome["e2el"] = [end - sent]
    return outcome
