"""Grammars through xgrammar (the library vLLM defaults to; docs/performance.md has the
comparison with llguidance that chose it).

The compiler and the tokenizer's info are built on the first structured request, so an
engine that never gets one pays nothing at start-up.
"""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from decodegraph.structured_output.params import GrammarKey

# xgrammar's C++ errors start with a time stamp and a source location: noise to a client.
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def _clean(error: Exception) -> str:
    return _LOCATION.sub("", str(error)).strip()


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    # A JSON string literal is also an EBNF string literal with the same escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarGrammar:
    """One request's matcher: what may come next, and the tokens it has taken."""

    __slots__ = ("matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and no change) when the grammar forbids it."""
        if self.matcher.is_terminated():
            return False
        return self.matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` (int32, one bit per token) gets the allowed tokens; a
        terminated grammar (its stop token taken) allows only stop tokens again."""
        if self.matcher.is_terminated():
            bitmask[row].zero_()
            set_bits(bitmask, row, self.matcher.stop_token_ids)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def set_bits(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    """Allow `token_ids` in row `row` of an int32 bitmask."""
    for t in token_ids:
        bit = t % 32
        # Bit 31 of an int32 is its sign bit.
        bitmask[row, t // 32] |= (1 << bit) - (1 << 32 if bit == 31 else 0)


class XgrammarBackend:
    """Compiles grammar specs for one tokenizer; `compile` raises ValueError naming the
    request field when a spec is invalid."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # xgrammar's own cache stays off: StructuredOutputManager keeps one by spec.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        c = self.compiler
        try:
            if key.kind in ("json", "json_object"):
                # json_object is any JSON object, as vLLM compiles it.
                schema = key.spec if key.kind == "json" else '{"type": "object"}'
                return c.compile_json_schema(schema, any_whitespace=not key.disable_any_whitespace)
            if key.kind == "regex":
                return c.compile_regex(key.spec)
            if key.kind == "choice":
                return c.compile_grammar(choice_grammar(json.loads(key.spec)))
            if key.kind == "grammar":
                return c.compile_grammar(key.spec)
        except Exception as e:  # noqa: BLE001 - whatever the spec breaks is the spec's fault
            raise ValueError(f"structured_outputs.{key.kind}: {_clean(e)}") from e
        raise ValueError(f"structured_outputs: unknown kind {key.kind!r}")

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(compiled)

    def allow_stop_tokens(self, bitmask: torch.Tensor, row: int) -> None:
        set_bits(bitmask, row, self.stop_token_ids)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A bitmask of `num_rows` rows that allows every token."""
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """In place: in each of `rows`, tokens its bitmask row forbids get -inf."""
        bitmask = bitmask.to(logits.device, non_blocking=True)
        indices = None if len(rows) == logits.shape[0] else rows
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=indices
        )
