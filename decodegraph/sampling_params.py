"""Sampling parameters of one request, spelled and defaulted as vLLM's.

Every invalid value raises `ValueError` whose message starts with the field name, so the
OpenAI server can turn it into a 400 that tells the client which field is wrong.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from decodegraph.structured_output.params import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "SamplingType", "StructuredOutputsParams"]

# Below this temperature sampling is greedy (vLLM's `_SAMPLING_EPS`).
_SAMPLING_EPS = 1e-5
# `logprobs` / `prompt_logprobs` of this value ask for every token of the vocabulary.
ALL_LOGPROBS = -1


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries."""

    # The full text and token ids generated so far, every time.
    CUMULATIVE = 0
    # Only what is new since the previous output.
    DELTA = 1
    # One output, when the request is finished.
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    """How the sampler draws a request's next token."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(name: str, value: object) -> None:
    if not _is_number(value):
        raise ValueError(f"{name}: must be a number, got {value!r}")


def _check_int(name: str, value: object) -> None:
    if not _is_int(value):
        raise ValueError(f"{name}: must be an integer, got {value!r}")


@dataclass
class SamplingParams:
    """How to sample the tokens of one request (OpenAI / vLLM semantics)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # None: up to the context limit (the engine fills in the number).
    max_tokens: int | None = 16
    min_tokens: int = 0
    # Top logprobs per generated token; 0 returns only the sampled token's, -1 every
    # token's. The engine refuses more than its max_logprobs (ModelConfig).
    logprobs: int | None = None
    # Top logprobs per prompt token (the first has none); 0 returns only the prompt
    # token's, -1 every token's. A request that asks for them does not read the prefix
    # cache: every prompt position is computed (docs/design.md, "Prompt logprobs").
    prompt_logprobs: int | None = None
    # Token id -> value added to its logit before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Whether outputs carry text (vLLM's name). False: token ids only; the text and
    # every logprob's decoded_token stay empty, and no time goes to decoding them.
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output follows a JSON schema, regex, choice or grammar (None: free text).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._normalise_lists()
        self._verify()

    def _normalise_lists(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop: must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids: must be a list of integers, got {self.stop_token_ids!r}"
            )

    def _verify(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k: must be -1 (disable) or >= 0, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop: must be strings, got {s!r}")
            if not s:
                raise ValueError("stop: stop strings must not be empty")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids: must be non-negative integers, got {t!r}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < ALL_LOGPROBS:
                    raise ValueError(f"{name}: must be >= 0, or -1 for every token, got {value}")
        if self.logit_bias is not None:
            self._verify_logit_bias()
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop: stop strings need detokenize=True (they are found in the text)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind: must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs: must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )

    def _verify_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ValueError(
                f"logit_bias: must be a map of token id to bias, got {self.logit_bias!r}"
            )
        bias: dict[int, float] = {}
        for token, value in self.logit_bias.items():
            # JSON keys are strings ("50256"); accept those that spell an integer.
            if isinstance(token, str) and token.lstrip("-").isdigit():
                token = int(token)
            if not _is_int(token) or token < 0:
                raise ValueError(
                    f"logit_bias: token ids must be non-negative integers, got {token!r}"
                )
            if not _is_number(value):
                raise ValueError(f"logit_bias: biases must be numbers, got {value!r}")
            # Clamped to OpenAI's range, as vLLM does.
            bias[token] = min(100.0, max(-100.0, float(value)))
        self.logit_bias = bias

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature below 1e-5)."""
        return self.temperature < _SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY, RANDOM, or RANDOM_SEED (random with a per-request generator)."""
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        """An independent copy (lists are copied too)."""
        return dataclasses.replace(
            self,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,
        )

    def for_child(self, index: int) -> SamplingParams:
        """The params of child `index` of an `n > 1` request: n=1, and `seed + index`
        when seeded, so children differ but the whole request stays reproducible."""
        child = self.clone()
        child.n = 1
        if self.seed is not None:
            child.seed = self.seed + index
        return child
