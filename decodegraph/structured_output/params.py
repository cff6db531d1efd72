"""What a request asks its output to follow (vLLM's `StructuredOutputsParams`).

Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` is set. Every invalid
value raises `ValueError` whose message names the field (`structured_outputs.json: ...`),
as `SamplingParams` does, so the server can answer a 400 that says what is wrong.
"""

from __future__ import annotations

import json as json_lib
from dataclasses import dataclass
from typing import NamedTuple

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class GrammarKey(NamedTuple):
    """What a compiled grammar is cached under: the kind and its canonical spec text."""

    kind: str
    spec: str
    # JSON schemas only: whitespace is limited to single spaces after separators.
    disable_any_whitespace: bool = False


@dataclass
class StructuredOutputsParams:
    """One of: a JSON schema, a regular expression, a list of choices, an EBNF grammar,
    or any JSON object (`json_object=True`)."""

    # A JSON schema, as a dict or its JSON text.
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    # An EBNF (GBNF) grammar whose start rule is `root`.
    grammar: str | None = None
    json_object: bool | None = None
    # Without it a JSON schema lets the model put any whitespace between tokens, which a
    # sampled model can repeat until max_tokens (vLLM's flag of the same name).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar or "
                f"json_object must be set, got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json: must be a JSON schema (object or text)")
        if isinstance(self.json, str):
            try:
                parsed = json_lib.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from e
            if not isinstance(parsed, dict):
                raise ValueError("structured_outputs.json: a JSON schema must be an object")
        elif isinstance(self.json, dict):
            try:
                json_lib.dumps(self.json)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json: not JSON-serialisable: {e}") from e
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    "structured_outputs.choice: must be a non-empty list of non-empty strings"
                )
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object: must be a boolean")

    @property
    def kind(self) -> str:
        """Which of the fields is set."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> GrammarKey:
        """The cache key: equal specs (a schema as a dict or as text) share a grammar."""
        kind = self.kind
        if kind == "json":
            schema = self.json if isinstance(self.json, dict) else json_lib.loads(self.json)
            spec = json_lib.dumps(schema, sort_keys=True, separators=(",", ":"))
            return GrammarKey(kind, spec, self.disable_any_whitespace)
        if kind == "choice":
            return GrammarKey(kind, json_lib.dumps(self.choice))
        if kind == "json_object":
            return GrammarKey(kind, "", self.disable_any_whitespace)
        return GrammarKey(kind, getattr(self, kind))
