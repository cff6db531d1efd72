"""Decode speed and KV memory at a long context, with a sliding window and without.

Two random Mistral-shaped checkpoints, the same but for `sliding_window` (W tokens, or
none), are saved with transformers; each request prefills a prompt of `--context` random
tokens and decodes `--tokens` more. The decode steps are timed (the prefill is not), at
each `--batch-size`, in rounds that alternate between the two models, so that a noisy
period of the machine hits both. The windowed model's attention reads W positions per
token instead of the whole context, and its KV cache group holds O(W) blocks per request.

    python benchmarks/bench_window.py                       # 4k context, window 256
    python benchmarks/bench_window.py --context 8000 --window 512 --batch-size 1 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MistralConfig

from decodegraph import LLM, SamplingParams
from decodegraph.benchmarks.common import print_table, write_json

ROOT = Path(__file__).resolve().parents[1]


def make_checkpoint(root: Path, window: int | None, max_len: int) -> Path:
    config = MistralConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        sliding_window=window,
        tie_word_embeddings=True,
        architectures=["MistralForCausalLM"],
        dtype="float32",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = root / (f"window{window}" if window else "full")
    model.save_pretrained(out)
    return out


def decode_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[int]]:
    """Decode tokens/s of one batch once every prefill is done, and the most KV blocks
    in use per group meanwhile."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    sched = engine.scheduler
    while sched.num_waiting or any(r.num_output_tokens == 0 for r in sched.running):
        engine.step()  # the prefills (chunked by the token budget)
    before = sum(r.num_output_tokens for r in sched.running)
    start, peak = time.perf_counter(), [0] * len(sched.kv_cache_manager.managers)
    while engine.has_unfinished_requests():
        engine.step()
        for g, m in enumerate(sched.kv_cache_manager.managers):
            peak[g] = max(peak[g], m.pool.num_blocks - 1 - m.pool.num_free_blocks)
    elapsed = time.perf_counter() - start
    return (len(prompts) * tokens - before) / elapsed, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_window.json"))
    args = parser.parse_args()
    max_len = args.context + args.tokens + 16
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            "window": make_checkpoint(Path(tmp), args.window, max_len),
            "full": make_checkpoint(Path(tmp), None, max_len),
        }
        llms = {
            name: LLM(
                str(path),
                skip_tokenizer_init=True,
                max_model_len=max_len,
                max_num_seqs=max(args.batch_size),
                max_num_batched_tokens=4096,
            )
            for name, path in paths.items()
        }
        rates: dict[tuple[str, int], list[float]] = {}
        blocks: dict[tuple[str, int], list[int]] = {}
        for _ in range(args.rounds):
            for size in args.batch_size:
                prompts = [
                    [rng.randrange(3, 1024) for _ in range(args.context)] for _ in range(size)
                ]
                for name, llm in llms.items():
                    rate, used = decode_rate(llm, prompts, args.tokens)
                    rates.setdefault((name, size), []).append(rate)
                    blocks[(name, size)] = used
    rows, results = [], {}
    for (name, size), values in rates.items():
        median = statistics.median(values)
        ratio = median / statistics.median(rates[("full", size)])
        rows.append([name, size, median, ratio, ", ".join(map(str, blocks[(name, size)]))])
        results[f"{name}/{size}"] = {
            "decode_tokens_per_s": median,
            "rounds": values,
            "kv_blocks_in_use": blocks[(name, size)],
        }
    print(f"context {args.context}, window {args.window}, {args.tokens} decode steps per round")
    print_table(["model", "batch", "decode tok/s", "x full", "most KV blocks in use"], rows)
    write_json(
        args.out,
        "window",
        {"context": args.context, "window": args.window, "tokens": args.tokens, "results": results},
    )


if __name__ == "__main__":
    main()
