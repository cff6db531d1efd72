"""Requests for tests: greedy sampling parameters, engine requests, runner states."""

from __future__ import annotations

import torch

from decodegraph.request import Request
from decodegraph.sampling_params import SamplingParams
from decodegraph.worker.input_batch import CachedRequestState


def greedy(max_tokens: int = 24, ignore_eos: bool = True) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (unless ignore_eos is False)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def make_request(
    req_id: str,
    prompt: list[int],
    eos: int | None = None,
    output: list[int] | None = None,
    **params: object,
) -> Request:
    """An engine request of `prompt` (SamplingParams from `params`, max_tokens 8 unless
    given), with `output` already generated."""
    params.setdefault("max_tokens", 8)
    request = Request(req_id, list(prompt), SamplingParams(**params), eos_token_id=eos)  # type: ignore[arg-type]
    for token in output or []:
        request.append_output_token(token)
    return request


def make_request_state(
    req_id: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: int | None = None,
    **params: object,
) -> CachedRequestState:
    """The model runner's state of a request (what sampling reads), seeded where asked."""
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    prompt = list(prompt or [1, 2, 3])
    generator = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
    state = CachedRequestState(
        req_id, prompt, sp, eos, generator, ([],), 0, all_token_ids=list(prompt)
    )
    for token in output or []:
        state.append_output_token(token)
    return state
