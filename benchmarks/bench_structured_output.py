"""Structured outputs: what a grammar costs, xgrammar beside llguidance, and in the engine.

Measures on one tokenizer (stories260K's by default):
- per library and grammar kind (a JSON schema, json_object, a regex, a choice, an EBNF /
  Lark grammar): the seconds from the spec to the first token mask ("compile": compile,
  matcher and first mask, the library's own cache off), median of --repeats;
- per library and kind, the cost of one decode step's grammar work: filling one row's
  token bitmask, and accepting the chosen token, over a --steps-token random walk
  through the grammar (each step picks a random allowed token; a finished grammar
  starts over), medians in microseconds;
- in the engine (xgrammar, the one wired in): decode tokens/s of --batch requests at
  temperature 1, free text against the same requests under an EBNF grammar that never
  ends within --tokens, and the engine's own grammar work per step (bitmask, masking,
  matcher advance) timed inside the step.

Prints tables and saves JSON under benchmarks/results/.

    python benchmarks/bench_structured_output.py
    python benchmarks/bench_structured_output.py --skip-engine --steps 2000
    python benchmarks/bench_structured_output.py --libraries xgrammar --batch 1 8 32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from decodegraph.benchmarks.common import print_table, write_json
from decodegraph.models.bundled import bundled_model_path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = bundled_model_path("stories260K")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["happy", "sad", "sleepy"]
EBNF = 'root ::= "The " animal " is " mood\nanimal ::= "cat" | "dog"\nmood ::= "happy" | "sad"'
LARK = 'start: "The " animal " is " mood\nanimal: "cat" | "dog"\nmood: "happy" | "sad"'
KINDS = ["json_schema", "json_object", "regex", "choice", "grammar"]
# The engine workload's grammar: lower-case text and spaces, ended only by a "~" the
# story model practically never writes, so every request runs to max_tokens.
LONG_GRAMMAR = 'root ::= [a-z ]* "~"'


class _Walk:
    """One library's matcher in the random walk: fill, pick, accept, restart."""

    def fill(self, bitmask: torch.Tensor) -> None: ...
    def accept(self, token: int) -> None: ...
    def finished(self) -> bool: ...
    def reset(self) -> None: ...


def _xgrammar(tokenizer: Any, vocab_size: int, stop: list[int]) -> Callable[[str], Any]:
    import xgrammar as xgr

    from decodegraph.structured_output.backend_xgrammar import choice_grammar

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)

    def compile_kind(kind: str) -> Any:
        c = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        if kind == "json_schema":
            return c.compile_json_schema(PERSON, any_whitespace=False)
        if kind == "json_object":
            return c.compile_json_schema({"type": "object"}, any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(EMAIL)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(CHOICES))
        return c.compile_grammar(EBNF)

    class Walk(_Walk):
        def __init__(self, kind: str) -> None:
            self.m = xgr.GrammarMatcher(compile_kind(kind))

        def fill(self, bitmask: torch.Tensor) -> None:
            self.m.fill_next_token_bitmask(bitmask, 0)

        def accept(self, token: int) -> None:
            assert self.m.accept_token(token)

        def finished(self) -> bool:
            return self.m.is_terminated()

        def reset(self) -> None:
            self.m.reset()

    return Walk


def _llguidance(tokenizer: Any, vocab_size: int, stop: list[int]) -> Callable[[str], Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop)
    compact = {"whitespace_flexible": False}

    def grammar(kind: str) -> str:
        g = llguidance.LLMatcher
        if kind == "json_schema":
            return g.grammar_from_json_schema(PERSON, defaults=compact)
        if kind == "json_object":
            return g.grammar_from_json_schema({"type": "object"}, defaults=compact)
        if kind == "regex":
            return g.grammar_from_regex(EMAIL)
        if kind == "choice":
            return g.grammar_from_regex("(" + "|".join(CHOICES) + ")")
        return g.grammar_from_lark(LARK)

    class Walk(_Walk):
        def __init__(self, kind: str) -> None:
            self.m = llguidance.LLMatcher(ll_tokenizer, grammar(kind))
            assert not self.m.is_error(), self.m.get_error()

        def fill(self, bitmask: torch.Tensor) -> None:
            llt.fill_next_token_bitmask(self.m, bitmask, 0)

        def accept(self, token: int) -> None:
            assert self.m.consume_token(token)

        def finished(self) -> bool:
            return self.m.is_stopped()

        def reset(self) -> None:
            self.m.reset()

    return Walk


LIBRARIES = {"xgrammar": _xgrammar, "llguidance": _llguidance}


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def _library(walk_cls: Any, kind: str, vocab: int, stop: set[int], args: Any) -> dict[str, Any]:
    ready = []
    for _ in range(args.repeats):
        bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
        start = time.perf_counter()
        walk = walk_cls(kind)
        walk.fill(bitmask)
        ready.append(time.perf_counter() - start)
    rng = random.Random(0)
    fills, accepts = [], []
    walk = walk_cls(kind)
    restarts = 0
    for _ in range(args.steps):
        start = time.perf_counter()
        walk.fill(bitmask)
        fills.append(time.perf_counter() - start)
        allowed = _allowed(bitmask, vocab)
        text_tokens = [t for t in allowed if t not in stop]
        token = rng.choice(text_tokens or allowed)
        start = time.perf_counter()
        walk.accept(token)
        accepts.append(time.perf_counter() - start)
        if walk.finished() or not text_tokens:
            walk.reset()
            restarts += 1
    return {
        "compile_ms": statistics.median(ready) * 1e3,
        "fill_us": statistics.median(fills) * 1e6,
        "accept_us": statistics.median(accepts) * 1e6,
        "fill_p90_us": statistics.quantiles(fills, n=10)[-1] * 1e6,
        "restarts": restarts,
    }


def _engine(args: Any) -> dict[str, Any]:
    """Free text against grammar-constrained requests in the engine, and the engine's
    grammar work per step."""
    from decodegraph import LLM, SamplingParams
    from decodegraph.sampling_params import StructuredOutputsParams
    from decodegraph.structured_output import manager as manager_module
    from decodegraph.structured_output.backend_xgrammar import XgrammarGrammar

    llm = LLM(args.model, max_model_len=args.tokens + 16, max_num_seqs=max(args.batch), seed=0)
    grammar_seconds = [0.0]

    def timed(fn: Callable) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                grammar_seconds[0] += time.perf_counter() - start

        return wrapper

    # The three places the engine spends on grammars each step.
    mgr = llm.llm_engine.structured_output
    mgr.grammar_bitmask = timed(mgr.grammar_bitmask)
    manager_module.StructuredOutputMask.apply_ = timed(manager_module.StructuredOutputMask.apply_)
    XgrammarGrammar.accept_token = timed(XgrammarGrammar.accept_token)

    spec = StructuredOutputsParams(grammar=LONG_GRAMMAR)
    rows = []
    for batch in args.batch:
        prompts = [{"prompt_token_ids": [1, 30 + 7 * i]} for i in range(batch)]
        result: dict[str, Any] = {"batch": batch}
        for label, so in (("free", None), ("grammar", spec)):
            params = [
                SamplingParams(
                    temperature=1.0,
                    seed=i,
                    max_tokens=args.tokens,
                    ignore_eos=so is None,
                    structured_outputs=so,
                )
                for i in range(batch)
            ]
            llm.generate(prompts, params, use_tqdm=False)  # warm-up (and the compile)
            rates, per_step = [], []
            for _ in range(args.repeats):
                grammar_seconds[0] = 0.0
                steps_before = sum(llm.llm_engine.runner.graph_runner.mode_counts.values())
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                steps = sum(llm.llm_engine.runner.graph_runner.mode_counts.values()) - steps_before
                rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
                per_step.append(grammar_seconds[0] / max(steps, 1))
            result[f"{label}_tok_s"] = statistics.median(rates)
            if so is not None:
                result["grammar_us_per_step"] = statistics.median(per_step) * 1e6
        result["grammar_over_free"] = result["grammar_tok_s"] / result["free_tok_s"]
        rows.append(result)
    mode = llm.llm_engine.config.compilation_config.cudagraph_mode.name
    return {"graph_mode": mode, "tokens": args.tokens, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="its tokenizer is measured")
    p.add_argument("--libraries", nargs="+", default=list(LIBRARIES), choices=list(LIBRARIES))
    p.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=1000, help="random-walk tokens per grammar")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="engine batch sizes")
    p.add_argument("--tokens", type=int, default=128, help="engine tokens per request")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "bench_structured_output.json")
    )
    args = p.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    stop = [tokenizer.eos_token_id]
    libraries: dict[str, dict[str, Any]] = {}
    table = []
    for name in args.libraries:
        walk_cls = LIBRARIES[name](tokenizer, vocab, stop)
        libraries[name] = {}
        for kind in args.kinds:
            r = libraries[name][kind] = _library(walk_cls, kind, vocab, set(stop), args)
            table.append(
                [name, kind, r["compile_ms"], r["fill_us"], r["fill_p90_us"], r["accept_us"]]
            )
    print(f"vocabulary {vocab} tokens, {args.steps}-token walks, medians")
    print_table(
        ["library", "kind", "compile+first mask ms", "mask µs", "mask p90 µs", "accept µs"], table
    )
    payload: dict[str, Any] = {"model": args.model, "vocab_size": vocab, "libraries": libraries}
    if not args.skip_engine:
        engine = payload["engine"] = _engine(args)
        print(f"engine, {engine['graph_mode']}, {args.tokens} tokens per request, temperature 1")
        print_table(
            ["batch", "free tok/s", "grammar tok/s", "grammar/free", "grammar µs/step"],
            [
                [
                    r["batch"],
                    r["free_tok_s"],
                    r["grammar_tok_s"],
                    r["grammar_over_free"],
                    r["grammar_us_per_step"],
                ]
                for r in engine["rows"]
            ],
        )
    write_json(args.out, "structured_output", payload)


if __name__ == "__main__":
    main()
