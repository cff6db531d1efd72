"""vLLM's check_logprobs_close rule, as the GPU check and bf16 tests use it."""

from __future__ import annotations

import pytest

from decodegraph.benchmarks.accuracy import check_logprobs_close, first_divergence


def _seq(ids: list[int], tops: list[set[int]]) -> tuple[list[int], list[dict[int, float]]]:
    return ids, [dict.fromkeys(t, 0.0) for t in tops]


def test_identical_sequences_are_close() -> None:
    a = _seq([1, 2, 3], [{1}, {2}, {3}])
    check_logprobs_close([a], [a], "x", "y")
    assert first_divergence([a], [a]) == [None]


def test_a_divergence_at_a_near_tie_is_close_and_ends_the_comparison() -> None:
    a = _seq([1, 2, 3, 9], [{1}, {2, 5}, {3}, {9}])
    b = _seq([1, 5, 7, 8], [{1}, {5, 2}, {7}, {8}])
    check_logprobs_close([a], [b], "x", "y")
    assert first_divergence([a], [b]) == [1]


@pytest.mark.parametrize("tops_b", [[{1}, {5}], [{1}, {5, 2}]])
def test_a_divergence_outside_either_top_k_is_not_close(tops_b: list[set[int]]) -> None:
    a = _seq([1, 2], [{1}, {2}])  # 5 is not in a's top logprobs
    b = _seq([1, 5], tops_b)
    with pytest.raises(AssertionError, match="sequence 0, token 1: x chose 2, y chose 5"):
        check_logprobs_close([a], [b], "x", "y")


def test_different_sequence_counts_are_refused() -> None:
    a = _seq([1], [{1}])
    with pytest.raises(AssertionError, match="x has 1 sequences, y 2"):
        check_logprobs_close([a], [a, a], "x", "y")
