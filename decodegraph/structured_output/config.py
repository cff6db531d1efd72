"""Engine-wide structured-output settings (vLLM's `--structured-outputs-config`)."""

from __future__ import annotations

from dataclasses import dataclass

from decodegraph.config_parsing import dataclass_from_any

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
        return dataclass_from_any(cls, value, "structured_outputs_config")
