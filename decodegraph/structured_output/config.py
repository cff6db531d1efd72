"""Engine-wide structured-output settings (vLLM's `--structured-outputs-config`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

_BACKENDS = ("auto", "xgrammar")


@dataclass
class StructuredOutputsConfig:
    """How every request's grammar is compiled."""

    # "auto" is xgrammar, the one backend (docs/performance.md says why).
    backend: str = "auto"
    # JSON grammars (json schemas, json_object) allow no whitespace beyond one space
    # after separators: a sampled model cannot then pad the output until max_tokens.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend: {self.backend!r} is not one of "
                f"{', '.join(_BACKENDS)}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs_config.disable_any_whitespace: must be a bool")

    @classmethod
    def from_any(
        cls, value: StructuredOutputsConfig | dict | str | None
    ) -> StructuredOutputsConfig:
        """Accept a `StructuredOutputsConfig`, a dict, a JSON string, or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(
                f"structured_outputs_config: expected a dict, got {type(value).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs_config: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**value)
