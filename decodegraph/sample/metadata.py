"""Per-step sampling inputs, gathered from the batch's requests.

Building this runs every step, so it is kept cheap: what depends only on the batch
composition (temperatures, top-k/p, min-p, generators, logprob counts) is kept in a
`BatchStaticsCache` (one per model runner) and reused while the same requests stay in
the same rows; tensors that change every step (penalty counts, min-tokens masks) are
built only when some request needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from decodegraph.sampling_params import SamplingParams
    from decodegraph.structured_output.manager import StructuredOutputMask


class SamplingRequest(Protocol):
    """What sampling reads of a request (the model runner's `CachedRequestState`)."""

    sampling_params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    eos_token_id: int | None

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor from host data; on an accelerator via pinned memory, so the copy does
    not wait for the device queue to drain."""
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class _BatchStatics:
    """What depends only on which requests sit in which rows."""

    all_greedy: bool
    all_random: bool
    # Row is greedy; None when no row is (all random) or every row is.
    is_greedy: torch.Tensor | None
    # Per row, 1.0 for greedy rows (they take the argmax, this only avoids 0/0).
    temperature: torch.Tensor | None
    # Per row, vocab_size where disabled; None when no row uses top-k.
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    # Row -> its request's own generator (seeded requests).
    generators: dict[int, torch.Generator]
    # Per row, how many top logprobs it wants (None: no logprobs).
    num_logprobs: list[int | None]
    max_num_logprobs: int | None
    has_penalties: bool
    has_repetition_penalty: bool
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    has_min_tokens: bool
    # (rows, token ids, biases) of the requests' logit_bias; None when none has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, and nothing ever edits its logits or asks for logprobs:
        one argmax is the whole job whatever the step (SamplingMetadata.is_fast_greedy
        without a grammar mask)."""
        return (
            self.all_greedy
            and not self.has_penalties
            and not self.has_min_tokens
            and self.max_num_logprobs is None
            and self.logit_bias is None
        )


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step; row b belongs to requests[b]."""

    statics: _BatchStatics
    # Per row, count of each token among the output tokens [B, V] (penalties only).
    output_token_counts: torch.Tensor | None
    # Per row, whether each token is in the prompt [B, V] (repetition penalty only).
    prompt_token_mask: torch.Tensor | None
    # (rows, token ids) to mask to -inf because min_tokens is not reached yet.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    # Rows whose grammar limits the next token (structured outputs); set by the runner.
    structured_output_mask: StructuredOutputMask | None = None

    @property
    def all_greedy(self) -> bool:
        return self.statics.all_greedy

    @property
    def max_num_logprobs(self) -> int | None:
        return self.statics.max_num_logprobs

    @property
    def is_fast_greedy(self) -> bool:
        """One argmax is the whole job: all greedy, nothing edits logits, no logprobs."""
        return (
            self.statics.all_greedy
            and self.output_token_counts is None
            and self.min_tokens_mask is None
            and self.statics.max_num_logprobs is None
            and self.structured_output_mask is None
            and self.statics.logit_bias is None
        )

    @classmethod
    def from_requests(
        cls,
        requests: list[SamplingRequest],
        vocab_size: int,
        device: torch.device | str,
        cache: BatchStaticsCache | None = None,
    ) -> SamplingMetadata:
        """Gather the sampling inputs of `requests` (row b = requests[b]); `cache`
        reuses the previous batch's statics when its requests sit in the same rows."""
        device = torch.device(device)
        if cache is None:
            statics = _build_statics(requests, vocab_size, device)
        else:
            statics = cache.get(requests, vocab_size, device)
        counts = prompt_mask = None
        if statics.has_penalties:
            counts, prompt_mask = _penalty_tensors(
                requests, vocab_size, device, statics.has_repetition_penalty
            )
        min_tokens_mask = None
        if statics.has_min_tokens:
            min_tokens_mask = _min_tokens_mask(requests, vocab_size, device)
        return cls(statics, counts, prompt_mask, min_tokens_mask)


class BatchStaticsCache:
    """The previous batch's statics, with strong references to its requests so that
    identity comparison cannot be fooled by a recycled object id."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[tuple[SamplingRequest, ...], int, torch.device, _BatchStatics] | None = (
            None
        )

    def get(
        self, requests: list[SamplingRequest], vocab_size: int, device: torch.device
    ) -> _BatchStatics:
        last = self._last
        if (
            last is not None
            and last[1] == vocab_size
            and last[2] == device
            and len(last[0]) == len(requests)
            and all(a is b for a, b in zip(last[0], requests, strict=True))
        ):
            return last[3]
        statics = _build_statics(requests, vocab_size, device)
        self._last = (tuple(requests), vocab_size, device, statics)
        return statics


def _build_statics(
    requests: list[SamplingRequest], vocab_size: int, device: torch.device
) -> _BatchStatics:
    params = [r.sampling_params for r in requests]
    greedy = [p.is_greedy for p in params]
    all_greedy = all(greedy)
    all_random = not any(greedy)
    temperature = top_k = top_p = min_p = is_greedy = None
    if not all_greedy:
        temperature = to_device(
            [1.0 if g else float(p.temperature) for g, p in zip(greedy, params, strict=True)],
            torch.float32,
            device,
        )
        if not all_random:
            is_greedy = to_device(greedy, torch.bool, device)
        if any(p.top_k > 0 for p in params):
            top_k = to_device(
                [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                torch.int64,
                device,
            )
        if any(p.top_p < 1.0 for p in params):
            top_p = to_device([float(p.top_p) for p in params], torch.float32, device)
        if any(p.min_p > 0.0 for p in params):
            min_p = to_device([float(p.min_p) for p in params], torch.float32, device)
    generators = {
        i: r.generator
        for i, (r, g) in enumerate(zip(requests, greedy, strict=True))
        if r.generator is not None and not g
    }
    num_logprobs = [p.logprobs for p in params]
    wanted = [k for k in num_logprobs if k is not None]
    has_penalties = any(p.has_penalties for p in params)
    has_rep = any(p.repetition_penalty != 1.0 for p in params)
    presence = frequency = repetition = None
    if has_penalties:
        presence = to_device([float(p.presence_penalty) for p in params], torch.float32, device)
        frequency = to_device([float(p.frequency_penalty) for p in params], torch.float32, device)
        repetition = to_device([float(p.repetition_penalty) for p in params], torch.float32, device)
    return _BatchStatics(
        all_greedy=all_greedy,
        all_random=all_random,
        is_greedy=is_greedy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generators=generators,
        num_logprobs=num_logprobs,
        max_num_logprobs=max(wanted) if wanted else None,
        has_penalties=has_penalties,
        has_repetition_penalty=has_rep,
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        has_min_tokens=any(p.min_tokens > 0 for p in params),
        logit_bias=_logit_bias(params, vocab_size, device),
    )


def _logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab_size:  # the engine rejects the others
                rows.append(i)
                cols.append(token)
                values.append(bias)
    if not rows:
        return None
    return (
        to_device(rows, torch.int64, device),
        to_device(cols, torch.int64, device),
        to_device(values, torch.float32, device),
    )


def _padded(rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0)
    return [r + [pad] * (width - len(r)) for r in rows]


def _penalty_tensors(
    requests: list[SamplingRequest], vocab_size: int, device: torch.device, with_prompt: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # Padding points at an extra column that is cut off afterwards.
    batch = len(requests)
    out_ids = to_device(
        _padded([r.output_token_ids for r in requests], vocab_size), torch.int64, device
    )
    counts = torch.zeros(batch, vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    prompt_mask = None
    if with_prompt:
        prompt_ids = to_device(
            _padded([r.prompt_token_ids for r in requests], vocab_size), torch.int64, device
        )
        prompt_mask = torch.zeros(batch, vocab_size + 1, dtype=torch.bool, device=device)
        prompt_mask.scatter_(1, prompt_ids, True)
        prompt_mask = prompt_mask[:, :vocab_size]
    return counts[:, :vocab_size], prompt_mask


def _min_tokens_mask(
    requests: list[SamplingRequest], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        if r.eos_token_id is not None and not p.ignore_eos:
            banned.add(r.eos_token_id)
        for t in banned:
            if t < vocab_size:
                rows.append(i)
                cols.append(t)
    if not rows:
        return None
    return to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)
