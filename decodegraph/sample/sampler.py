"""Turns a step's logits into next tokens (and logprobs when asked).

Order, per row: the grammar's mask (structured outputs, as vLLM masks before its
sampler); logprobs from those logits; logit bias; min-tokens mask; penalties; then
greedy argmax, or temperature, top-k, top-p, min-p and a random draw. The draw is an
exponential race (argmax of probs / Exponential(1) noise), which is a sample from probs
without a host round trip, and lets a seeded request draw its noise from its own
generator so its tokens do not depend on the rest of the batch.

All results come to the host in one transfer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from decodegraph import native
from decodegraph.outputs import Logprob
from decodegraph.sample.metadata import SamplingMetadata


class SamplerOutput(NamedTuple):
    """Row b: the sampled token of requests[b] and, when it asked, its logprobs."""

    sampled_token_ids: list[int]
    # None when no row wants logprobs; else one entry per row, None for rows that did not.
    logprobs: list[dict[int, Logprob] | None] | None


# Logits below which greedy() takes torch's argmax or max(dim) rather than the CPU
# operator: there a call's overhead is most of the work (docs/performance.md).
NATIVE_ARGMAX_MIN_VALUES = 1024


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the first maximum (a NaN counts as the maximum, as in torch).
    On CPU in float32, for NATIVE_ARGMAX_MIN_VALUES logits or more, the native operator
    (csrc/argmax.h: vectorised, where torch's CPU max(dim) reduces a row a value at a
    time); otherwise one row through `argmax` and many through `max(dim)`, the faster of
    the two for each (docs/performance.md)."""
    if logits.dim() == 2 and logits.numel() >= NATIVE_ARGMAX_MIN_VALUES:
        ops = native.cpu_ops_for(logits)
        if ops is not None:
            return ops.argmax_rows(logits)
    if logits.shape[0] == 1:
        return logits.argmax(dim=-1)
    return logits.max(dim=-1).indices


class Sampler:
    """Samples one token per row of logits."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample from `logits` [B, V] (float32); never modifies `logits`."""
        if metadata.structured_output_mask is not None:
            # First, so logprobs and every later rule see only what the grammar allows.
            logits = logits.float().clone()
            metadata.structured_output_mask.apply_(logits)
        if metadata.is_fast_greedy:
            return SamplerOutput(greedy(logits).tolist(), None)
        statics = metadata.statics
        raw_logprobs = None
        if statics.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        if (
            metadata.min_tokens_mask is not None
            or metadata.output_token_counts is not None
            or statics.logit_bias is not None
        ):
            logits = logits.float().clone()
            if statics.logit_bias is not None:
                rows, cols, bias = statics.logit_bias
                logits.index_put_((rows, cols), bias, accumulate=True)
            if metadata.min_tokens_mask is not None:
                rows, cols = metadata.min_tokens_mask
                logits[rows, cols] = float("-inf")
            if metadata.output_token_counts is not None:
                apply_penalties(logits, metadata)

        if statics.all_greedy:
            sampled = greedy(logits)
        else:
            sampled = self._sample_random(logits, metadata)
            if statics.is_greedy is not None:
                sampled = torch.where(statics.is_greedy, greedy(logits), sampled)

        if raw_logprobs is None:
            return SamplerOutput(sampled.tolist(), None)
        return _with_logprobs(sampled, raw_logprobs, statics.num_logprobs)

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        statics = metadata.statics
        assert statics.temperature is not None
        logits = logits / statics.temperature.unsqueeze(1)
        if statics.top_k is not None or statics.top_p is not None:
            logits = apply_top_k_top_p(logits, statics.top_k, statics.top_p)
        probs = logits.softmax(dim=-1)
        if statics.min_p is not None:
            # Relative to the best token: tokens below min_p * max_prob are dropped.
            threshold = probs.amax(dim=-1, keepdim=True) * statics.min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return exponential_race(probs, statics.generators)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place: repetition penalty over prompt and output tokens (positive logits are
    divided, negative multiplied), presence and frequency penalties over output tokens
    (OpenAI: logit -= frequency * count + presence * (count > 0))."""
    statics = metadata.statics
    counts = metadata.output_token_counts
    assert counts is not None
    assert statics.presence_penalties is not None and statics.frequency_penalties is not None
    seen_in_output = counts > 0
    if metadata.prompt_token_mask is not None:
        assert statics.repetition_penalties is not None
        rep = statics.repetition_penalties.unsqueeze(1).expand_as(logits)
        seen = seen_in_output | metadata.prompt_token_mask
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
    logits -= statics.frequency_penalties.unsqueeze(1) * counts
    logits -= statics.presence_penalties.unsqueeze(1) * seen_in_output


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf every token outside a row's top-k, then outside its top-p nucleus
    (the smallest set of best tokens whose probability reaches p; never empty)."""
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        # Ascending order: the k best sit at positions >= V - k.
        kth_best = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_best, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1.0 - top_p).unsqueeze(1)
        outside[:, -1] = False  # keep the best token whatever p is
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exponential(1) is distributed as Categorical(probs).
    Seeded rows draw E from their own generator; the rest share one draw."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # A draw of exactly 0 would make 0/0 = NaN win the argmax for a masked token.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return greedy(probs.div_(noise))


def _with_logprobs(
    sampled: torch.Tensor, logprobs: torch.Tensor, num_logprobs: list[int | None]
) -> SamplerOutput:
    k = max(n for n in num_logprobs if n is not None)
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))
    # Rank 1 is the most likely token; ties share the better rank.
    rank = (logprobs > sampled_lp).sum(dim=-1, keepdim=True) + 1
    parts = [sampled.unsqueeze(1), rank, sampled_lp]
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        parts += [top_ids, top_lp]
    # float64 holds every token id, rank and float32 logprob exactly: one transfer.
    rows = torch.cat([p.to(torch.float64) for p in parts], dim=1).tolist()
    token_ids: list[int] = []
    out: list[dict[int, Logprob] | None] = []
    for row, n in zip(rows, num_logprobs, strict=True):
        token = int(row[0])
        token_ids.append(token)
        if n is None:
            out.append(None)
            continue
        entry = {token: Logprob(row[2], int(row[1]))}
        for j in range(n):
            top_id = int(row[3 + j])
            if top_id not in entry:
                entry[top_id] = Logprob(row[3 + k + j], j + 1)
        out.append(entry)
    return SamplerOutput(token_ids, out)
