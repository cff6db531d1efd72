"""Structured outputs for the engine (vLLM's `StructuredOutputManager`): compiles each
spec once, gives each request its own matcher, and builds a step's token bitmask.

The engine compiles a request's spec when the request arrives, so an invalid one is a
`ValueError` before anything is queued; the model runner then finds it in the cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from decodegraph.structured_output.config import StructuredOutputsConfig
from decodegraph.structured_output.params import GrammarKey, StructuredOutputsParams

# Distinct specs kept compiled; a server's clients mostly reuse a few schemas.
_CACHE_SIZE = 256


class StructuredOutputMask(NamedTuple):
    """A step's token bitmask: row i of `bitmask` (int32, one bit per token) is for
    sampled row i; only `rows` have a grammar (the others allow every token)."""

    bitmask: torch.Tensor
    rows: list[int]
    backend: object

    def apply_(self, logits: torch.Tensor) -> None:
        """In place: each masked row's forbidden tokens get -inf."""
        self.backend.apply_bitmask(logits, self.bitmask, self.rows)


class StructuredOutputManager:
    """Grammars by spec for one tokenizer and vocabulary."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        vocab_size: int,
        stop_token_ids: list[int],
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.config = config or StructuredOutputsConfig()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._backend = None
        self._cache: OrderedDict[GrammarKey, object] = OrderedDict()
        # The server's handlers and its engine thread both use the cache. Compiles run
        # one at a time under their own lock, so a long compile never holds up the
        # engine thread's look-ups of grammars already compiled.
        self._cache_lock = threading.Lock()
        self._compile_lock = threading.Lock()
        self.num_compiled = 0

    def __getstate__(self) -> dict:
        """What a worker process gets: the tokenizer and settings, not the compiled
        grammars, the backend or the locks (it compiles each spec once itself)."""
        return {
            "config": self.config,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "stop_token_ids": self.stop_token_ids,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(
            state["tokenizer"], state["vocab_size"], state["stop_token_ids"], state["config"]
        )

    @property
    def backend(self):  # noqa: ANN201 - the backend module loads on first use
        if self._backend is None:
            with self._compile_lock:
                self._make_backend()
        return self._backend

    def _make_backend(self) -> None:
        if self._backend is None:
            if self.tokenizer is None:
                raise ValueError(
                    "structured_outputs: needs a tokenizer (skip_tokenizer_init is set)"
                )
            from decodegraph.structured_output.backend_xgrammar import XgrammarBackend

            self._backend = XgrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled grammar of `params` (cached); ValueError naming the field when
        the spec is invalid."""
        key = params.key()
        if self.config.disable_any_whitespace and key.kind in ("json", "json_object"):
            key = key._replace(disable_any_whitespace=True)
        compiled = self._cached(key)
        if compiled is not None:
            return compiled
        backend = self.backend
        with self._compile_lock:
            compiled = self._cached(key)  # compiled by another thread meanwhile
            if compiled is not None:
                return compiled
            compiled = backend.compile(key)
            self._check_satisfiable(compiled, key)
            self.num_compiled += 1
            with self._cache_lock:
                self._cache[key] = compiled
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return compiled

    def _cached(self, key: GrammarKey) -> object | None:
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def _check_satisfiable(self, compiled: object, key: GrammarKey) -> None:
        """A grammar that allows no first token (`root ::= root`) would mask every logit
        of its request: refuse it with the other invalid specs."""
        backend = self.backend
        bitmask = backend.allocate_bitmask(1)
        backend.new_grammar(compiled).fill_bitmask(bitmask, 0)
        if not bitmask.any():
            raise ValueError(f"structured_outputs.{key.kind}: the grammar allows no output")

    def new_grammar(self, params: StructuredOutputsParams):  # noqa: ANN201
        """A fresh matcher for one request."""
        return self.backend.new_grammar(self.compile(params))

    def grammar_bitmask(self, grammars: list) -> StructuredOutputMask | None:
        """The bitmask for a step whose sampled row i has `grammars[i]` (None: free)."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        bitmask = self.backend.allocate_bitmask(len(grammars))
        for i in rows:
            grammars[i].fill_bitmask(bitmask, i)
        # The bitmask is on the host: numpy answers this faster than torch.
        nonempty = bitmask.numpy().any(axis=1)
        if not nonempty.all():
            # A dead end inside a grammar (no token continues it): let the request stop
            # rather than sample from a row of -inf.
            for i in (~nonempty).nonzero()[0].tolist():
                self.backend.allow_stop_tokens(bitmask, i)
        return StructuredOutputMask(bitmask, rows, self.backend)
