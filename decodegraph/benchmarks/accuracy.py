"""Comparing two runs' greedy outputs where bit equality cannot be expected (bf16, other
kernels, graphs against eager): vLLM's `check_logprobs_close` rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# One sequence: its token ids and, per token, the top logprobs (token id -> anything).
TokensWithLogprobs = tuple[Sequence[int], Sequence[Mapping[int, object]]]


def check_logprobs_close(
    outputs_0: Sequence[TokensWithLogprobs],
    outputs_1: Sequence[TokensWithLogprobs],
    name_0: str,
    name_1: str,
) -> None:
    """Each pair of sequences agrees token for token until a first difference, where
    each side's token must be among the other side's top logprobs (a near-tie); past it
    the sequences are allowed to differ. Raises AssertionError naming the first pair
    and position that break this."""
    if len(outputs_0) != len(outputs_1):
        raise AssertionError(f"{name_0} has {len(outputs_0)} sequences, {name_1} {len(outputs_1)}")
    for i, ((ids_0, lps_0), (ids_1, lps_1)) in enumerate(zip(outputs_0, outputs_1, strict=True)):
        for pos, (a, b) in enumerate(zip(ids_0, ids_1, strict=False)):
            if a == b:
                continue
            if a not in lps_1[pos] or b not in lps_0[pos]:
                raise AssertionError(
                    f"sequence {i}, token {pos}: {name_0} chose {a}, {name_1} chose {b}, and "
                    f"each is not in the other's top logprobs ({name_0}: {sorted(lps_0[pos])}, "
                    f"{name_1}: {sorted(lps_1[pos])})"
                )
            break  # diverged at a near-tie: what follows depends on different prefixes


def first_divergence(
    outputs_0: Sequence[TokensWithLogprobs], outputs_1: Sequence[TokensWithLogprobs]
) -> list[int | None]:
    """Per sequence pair, the first position whose tokens differ (None: none do)."""
    return [
        next((p for p, (a, b) in enumerate(zip(x[0], y[0], strict=False)) if a != b), None)
        for x, y in zip(outputs_0, outputs_1, strict=True)
    ]
