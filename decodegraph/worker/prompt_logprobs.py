"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the model runner's part.

A step computes logits only for each request's last scheduled token, which is all that
sampling needs. A request that asks for prompt logprobs needs them at every prompt
position but the last: position p's logits give the logprob of prompt token p + 1. So
after the forward, the hidden states of those positions are taken from the step's
output (every token row is there in every runtime mode: eager and piecewise steps
return hidden states for all rows, a mixed full graph too, and a uniform full graph's
per-row logits are per token, one token per request), turned into logits, and reduced
to the prompt token's logprob and rank plus the top-k.

The results accumulate in the request's runner state across chunked-prefill steps and
go out whole with the step that samples the request's first token, as vLLM sends them.
Positions already computed are never computed twice: a request preempted before its
first token resumes from the next position it lacks. Such a request never reads the
prefix cache (`Request.skip_reading_prefix_cache`), so no prompt position is skipped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from decodegraph.outputs import Logprob
from decodegraph.worker.request_state import CachedRequestState


class PromptLogprobRows(NamedTuple):
    """The token rows of one step whose logits feed prompt logprobs."""

    # Batch row (request) and how many positions it contributes, in row order.
    requests: list[tuple[int, int]]
    # Token rows of the step's hidden states (or of per-row logits), in order.
    token_rows: list[int]
    # The prompt token each row's logits are scored against.
    targets: list[int]


def find_rows(
    states: list[CachedRequestState], num_scheduled: list[int], query_start_loc: list[int]
) -> PromptLogprobRows | None:
    """The rows this step computes that some request's prompt logprobs still lack; None
    when there are none. `states`' computed tokens already count this step's."""
    requests: list[tuple[int, int]] = []
    token_rows: list[int] = []
    targets: list[int] = []
    for i, (state, n) in enumerate(zip(states, num_scheduled, strict=True)):
        done = state.prompt_logprobs
        if done is None:
            continue
        prompt = state.prompt_token_ids
        first = state.num_computed_tokens - n
        # Position p scores prompt token p + 1; `done` holds positions 0 .. len(done) - 1.
        lo, hi = max(first, len(done)), min(state.num_computed_tokens, len(prompt) - 1)
        if lo >= hi:
            continue
        start = query_start_loc[i] + lo - first
        token_rows.extend(range(start, start + hi - lo))
        targets.extend(prompt[lo + 1 : hi + 1])
        requests.append((i, hi - lo))
    if not token_rows:
        return None
    return PromptLogprobRows(requests, token_rows, targets)


# Values moved to Python lists at once: a whole-vocabulary request's rows (k = vocab)
# go over a few at a time, so the top-k and its float64 copy stay near 8 MiB whatever
# the vocabulary.
_VALUES_PER_TRANSFER = 1 << 20


# Prompt positions scored at once: bounds their logits to this many [vocab] rows.
_SLICE = 512


def score(
    model: torch.nn.Module,
    states: list[CachedRequestState],
    rows: PromptLogprobRows,
    logits: torch.Tensor,
    hidden: torch.Tensor | None,
) -> None:
    """Score the prompt positions of `rows` from this step's hidden states and add them
    to the requests' states; without hidden states (a uniform full graph) each request
    ran one token, and its row of `logits` is that token's."""
    k = num_top(states, rows)
    entries = []
    # In slices, so that a long prompt's logits never take more than a slice's
    # [rows, vocab] at once.
    for start in range(0, len(rows.token_rows), _SLICE):
        token_rows = rows.token_rows[start : start + _SLICE]
        if hidden is None:
            # Token row r is request row r in a uniform batch.
            token_logits = logits[token_rows]
        else:
            index = torch.tensor(token_rows, dtype=torch.int64, device=hidden.device)
            token_logits = model.compute_logits(hidden[index])
        entries += compute(token_logits, rows.targets[start : start + _SLICE], k)
    accumulate(states, rows, entries, k)


def compute(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, Logprob]]:
    """Per row of `logits` [N, V]: the target token's Logprob (with its rank) and the
    top-k (ranks 1..k), the target first, as the sampler gives generated tokens'.

    Cost: a log-softmax, a rank count and a top-k per row, then k + 1 Logprob objects
    per row in Python; with k = V (prompt_logprobs=-1) that is V objects per prompt
    position (docs/design.md, "Prompt logprobs")."""
    step = max(1, _VALUES_PER_TRANSFER // (3 + 2 * k))
    out = []
    for start in range(0, logits.shape[0], step):
        out += _entries(logits[start : start + step], targets[start : start + step], k)
    return out


def _entries(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, Logprob]]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, dtype=torch.int64, device=logprobs.device).unsqueeze(1)
    target_lp = logprobs.gather(1, target)
    rank = (logprobs > target_lp).sum(dim=-1, keepdim=True) + 1
    parts = [target, rank, target_lp]
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        parts += [top_ids, top_lp]
    # float64 holds every token id, rank and float32 logprob exactly: one transfer.
    rows = torch.cat([p.to(torch.float64) for p in parts], dim=1).tolist()
    out = []
    for row in rows:
        entry = {int(row[0]): Logprob(row[2], int(row[1]))}
        for j in range(k):
            top_id = int(row[3 + j])
            if top_id not in entry:
                entry[top_id] = Logprob(row[3 + k + j], j + 1)
        out.append(entry)
    return out


def num_top(states: list[CachedRequestState], rows: PromptLogprobRows) -> int:
    """The most top logprobs any of the rows' requests asks for."""
    return max(states[i].sampling_params.prompt_logprobs or 0 for i, _ in rows.requests)


def accumulate(
    states: list[CachedRequestState],
    rows: PromptLogprobRows,
    entries: list[dict[int, Logprob]],
    k: int,
) -> None:
    """Append the rows' `entries` (from `compute` with top-`k`) to their requests'
    states, each cut to its own top-k."""
    start = 0
    for i, count in rows.requests:
        state = states[i]
        own_k = state.sampling_params.prompt_logprobs or 0
        for entry in entries[start : start + count]:
            if own_k < k:
                entry = {
                    t: lp for j, (t, lp) in enumerate(entry.items()) if j == 0 or lp.rank <= own_k
                }
            state.prompt_logprobs.append(entry)
        start += count


def take_finished(
    states: list[CachedRequestState], sample_rows: list[int]
) -> dict[str, list[dict[int, Logprob] | None]]:
    """Request id -> its whole prompt logprobs (None first, vLLM's shape), for the
    requests that sample their first token this step; their states stop collecting."""
    out: dict[str, list[dict[int, Logprob] | None]] = {}
    for i in sample_rows:
        state = states[i]
        done = state.prompt_logprobs
        if done is None or len(done) < len(state.prompt_token_ids) - 1:
            continue
        out[state.req_id] = [None, *done]
        state.prompt_logprobs = None
    return out
