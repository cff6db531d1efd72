"""Decode speed per graph mode, beside Hugging Face transformers, in one run.

Measures on one model (stories260K by default):
- batch-1 decode tokens/s per mode: one request generates --tokens tokens from BOS
  (EOS ignored), in --repeats rounds that alternate between the modes; tokens/s is one
  over the median decode-step time;
- the engine's own per-step work at batch 1 (median step time minus median forward);
- start-up seconds, capture seconds and graph count per mode;
- throughput of --num-requests requests x --batch-tokens tokens per mode, and of
  transformers `generate()` on the same batch, in --throughput-repeats rounds that run
  every mode and transformers once each: medians, and per mode the median over rounds
  of its tokens/s over transformers' in the same round (a noisy phase of this shared
  machine then hits both sides of a ratio);
- transformers `generate()` at batch 1, on the same weights.

Prints a table and saves JSON under benchmarks/results/.

    python benchmarks/bench_decode.py                       # every mode
    python benchmarks/bench_decode.py --modes NONE FULL_DECODE_ONLY --skip-hf
    python benchmarks/bench_decode.py --threads 2           # both sides at 2 threads

The engine and transformers run in one process at the same intra-op thread count: the
engine platform's (all cores but one) or --threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from decodegraph import LLM, SamplingParams
from decodegraph.benchmarks.common import GRAPH_MODES, write_json
from decodegraph.models.bundled import bundled_model_path
from decodegraph.sampling_params import RequestOutputKind

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = bundled_model_path("stories260K")


def _decode_steps(llm: LLM, tokens: int) -> tuple[list[float], list[float]]:
    """One batch-1 request of `tokens` tokens from BOS, stepped by hand: the seconds of
    each decode step and of the model forward inside it (the prefill step dropped)."""
    engine = llm.llm_engine
    runner = engine.runner
    forward_times: list[float] = []
    original = runner._forward

    def timed(step):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        out = original(step)
        forward_times.append(time.perf_counter() - start)
        return out

    runner._forward = timed
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
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
    finally:
        runner._forward = original
    return step_times[1:], forward_times[1:]


def _batch_prompt(i: int) -> list[int]:
    """Prompt i of the batched workload (both sides): BOS and one token."""
    return [1, (7 * i) % 400 + 30]


def _throughput(llm: LLM, num_requests: int, tokens: int) -> float:
    """Tokens/s of one run of the batched workload."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": _batch_prompt(i)} for i in range(num_requests)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


_HF_GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def _hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_batch1(model: torch.nn.Module, tokens: int) -> float:
    """transformers' batch-1 tokens/s (after a warm-up run)."""
    ids = torch.tensor([[1]])
    model.generate(ids, max_new_tokens=8, min_new_tokens=8, **_HF_GREEDY)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **_HF_GREEDY)
    return tokens / (time.perf_counter() - start)


@torch.inference_mode()
def _hf_throughput(model: torch.nn.Module, num_requests: int, tokens: int) -> float:
    """transformers' tokens/s on one run of the batched workload."""
    batch = torch.tensor([_batch_prompt(i) for i in range(num_requests)])
    start = time.perf_counter()
    model.generate(batch, max_new_tokens=tokens, min_new_tokens=tokens, **_HF_GREEDY)
    return num_requests * tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--modes", nargs="+", default=GRAPH_MODES)
    p.add_argument("--tokens", type=int, default=256, help="batch-1 decode length")
    p.add_argument("--repeats", type=int, default=8, help="interleaved rounds")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=200)
    p.add_argument("--throughput-repeats", type=int, default=5, help="rounds (medians)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--no-inductor", action="store_true", help="CPU graphs replay the raw trace")
    p.add_argument("--threads", type=int, help="intra-op threads (DECODEGRAPH_CPU_THREADS)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_decode.json"))
    args = p.parse_args()
    if args.threads is not None:
        os.environ["DECODEGRAPH_CPU_THREADS"] = str(args.threads)

    results: dict[str, object] = {"model": args.model, "modes": {}}
    # Build every engine first, then measure in interleaved rounds, so that no mode
    # gains from running later (warm caches) on this shared, noisy machine.
    engines: dict[str, LLM] = {}
    for mode in dict.fromkeys(args.modes):
        start = time.perf_counter()
        engines[mode] = LLM(
            args.model,
            compilation_config={"cudagraph_mode": mode, "use_inductor": not args.no_inductor},
        )
        runner = engines[mode].llm_engine.runner
        results["modes"][mode] = {
            "resolved_mode": runner.graph_runner.mode.name,
            "startup_s": time.perf_counter() - start,
            "capture_s": runner.graph_runner.stats.seconds,
            "num_graphs": runner.graph_runner.stats.num_graphs,
            "batch1_tokens_per_s": 0.0,
        }
    # Read after the engines' platform set it; transformers below runs at the same count.
    results["threads"] = torch.get_num_threads()
    print(f"intra-op threads: {results['threads']}")
    steps: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in engines}
    for _ in range(args.repeats):
        for mode, llm in engines.items():
            step_times, forward_times = _decode_steps(llm, args.tokens)
            steps[mode][0].extend(step_times)
            steps[mode][1].extend(forward_times)
    for mode in engines:
        row = results["modes"][mode]
        step = statistics.median(steps[mode][0])
        forward = statistics.median(steps[mode][1])
        row["batch1_tokens_per_s"] = 1.0 / step
        row["step_us"] = step * 1e6
        row["forward_us"] = forward * 1e6
        row["overhead_us"] = (step - forward) * 1e6
    hf_model = None
    if not args.skip_hf:
        hf_model = _hf_model(Path(args.model))
        results["transformers"] = {"batch1_tokens_per_s": _hf_batch1(hf_model, args.tokens)}
    if not args.skip_throughput:
        rates: dict[str, list[float]] = {m: [] for m in engines}
        hf_rates: list[float] = []
        for _ in range(args.throughput_repeats):
            for mode, llm in engines.items():
                rates[mode].append(_throughput(llm, args.num_requests, args.batch_tokens))
            if hf_model is not None:
                hf_rates.append(_hf_throughput(hf_model, args.num_requests, args.batch_tokens))
        for mode in engines:
            row = results["modes"][mode]
            row["batched_tokens_per_s"] = statistics.median(rates[mode])
            row["batched_rounds"] = rates[mode]
            if hf_rates:
                row["batched_x_transformers"] = statistics.median(
                    r / h for r, h in zip(rates[mode], hf_rates, strict=True)
                )
        if hf_rates:
            results["transformers"]["batched_tokens_per_s"] = statistics.median(hf_rates)
            results["transformers"]["batched_rounds"] = hf_rates
    for mode in engines:
        row = results["modes"][mode]
        shown = {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
        print(mode, json.dumps(shown))
    if "transformers" in results:
        print("transformers", json.dumps(results["transformers"]))

    nan = float("nan")
    print(
        f"\n{'mode':<20}{'b1 tok/s':>10}{'x NONE':>8}{'step us':>9}{'other us':>9}"
        f"{'batched tok/s':>15}{'x HF':>7}{'startup s':>11}{'graphs':>8}"
    )
    base = results["modes"].get("NONE", {}).get("batch1_tokens_per_s")
    for mode, row in results["modes"].items():
        ratio = row["batch1_tokens_per_s"] / base if base else nan
        print(
            f"{mode:<20}{row['batch1_tokens_per_s']:>10.0f}{ratio:>8.2f}{row['step_us']:>9.0f}"
            f"{row['overhead_us']:>9.0f}{row.get('batched_tokens_per_s', nan):>15.0f}"
            f"{row.get('batched_x_transformers', nan):>7.2f}"
            f"{row['startup_s']:>11.1f}{row['num_graphs']:>8}"
        )
    if "transformers" in results:
        hf = results["transformers"]
        print(
            f"{'transformers':<20}{hf['batch1_tokens_per_s']:>10.0f}{'':>8}{'':>9}{'':>9}"
            f"{hf.get('batched_tokens_per_s', nan):>15.0f}"
        )
    print()
    write_json(args.out, "decode", results)


if __name__ == "__main__":
    main()
