"""The dispatcher, on CPU, for every mode: keys, padding, out-of-range sizes, mixed batches
and the graph-count table of docs/design.md §2 (the real-engine counts are in the e2e tests)."""

from __future__ import annotations

import pytest

from decodegraph.forward_context import BatchDescriptor
from decodegraph.graphs.dispatcher import CudagraphDispatcher
from decodegraph.graphs.modes import CUDAGraphMode, RuntimeMode

M = CUDAGraphMode
R = RuntimeMode
ALL_MODES = list(CUDAGraphMode)
SIZES = [1, 2, 4, 8, 16]


def _ids(mode: CUDAGraphMode) -> str:
    return mode.name


def _decode(n: int) -> BatchDescriptor:
    return BatchDescriptor(n, n, True)


def _mixed(num_tokens: int, num_reqs: int) -> BatchDescriptor:
    return BatchDescriptor(num_tokens, num_reqs, False)


def graphs_per_mode(mode: CUDAGraphMode, num_sizes: int, num_layers: int) -> int:
    """docs/design.md §2's 'graphs per capture size' column, times the number of sizes."""
    pieces = num_layers + 1
    per_size = {
        M.NONE: 0,
        M.PIECEWISE: pieces,
        M.FULL: 1,
        M.FULL_DECODE_ONLY: 1,
        M.FULL_AND_PIECEWISE: 1 + pieces,
    }[mode]
    return per_size * num_sizes


# ---------------------------------------------------------------- keys


@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_keys_per_mode(mode: CUDAGraphMode) -> None:
    d = CudagraphDispatcher(mode, [4, 1, 2])
    full = set(d.keys[R.FULL])
    piecewise = set(d.keys[R.PIECEWISE])
    decode_keys = {_decode(n) for n in (1, 2, 4)}
    mixed_keys = {BatchDescriptor(n, None, False) for n in (1, 2, 4)}
    expected = {
        M.NONE: (set(), set()),
        M.PIECEWISE: (set(), mixed_keys),
        # FULL serves uniform decode with its mixed-batch graphs: one graph per size.
        M.FULL: (mixed_keys, set()),
        M.FULL_DECODE_ONLY: (decode_keys, set()),
        M.FULL_AND_PIECEWISE: (decode_keys, mixed_keys),
    }[mode]
    assert (full, piecewise) == expected


@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_all_keys_come_largest_first_and_cover_every_key(mode: CUDAGraphMode) -> None:
    d = CudagraphDispatcher(mode, SIZES)
    keys = d.all_keys()
    assert len(keys) == len(d.keys[R.FULL]) + len(d.keys[R.PIECEWISE])
    assert len(set(keys)) == len(keys)
    sizes = [k.num_tokens for _, k in keys]
    assert sizes == sorted(sizes, reverse=True)
    for runtime_mode, key in keys:
        assert key in d.keys[runtime_mode]


@pytest.mark.parametrize("num_layers", [1, 2, 5])
@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_graph_count_table(mode: CUDAGraphMode, num_layers: int) -> None:
    """Full keys count one graph each, piecewise keys layers + 1 pieces each."""
    d = CudagraphDispatcher(mode, SIZES)
    count = sum(1 if m is R.FULL else num_layers + 1 for m, _ in d.all_keys())
    assert count == graphs_per_mode(mode, len(SIZES), num_layers)


def test_mode_none_has_no_capture_sizes() -> None:
    d = CudagraphDispatcher(M.NONE, SIZES)
    assert d.capture_sizes == []
    assert d.all_keys() == []


def test_capture_sizes_are_sorted() -> None:
    assert CudagraphDispatcher(M.FULL, [16, 1, 4]).capture_sizes == [1, 4, 16]


# ---------------------------------------------------------------- padding

PAD = [(1, 1), (2, 2), (3, 4), (5, 8), (7, 8), (8, 8), (9, 16), (16, 16)]


@pytest.mark.parametrize("n, padded", PAD)
def test_padded_size_is_the_next_capture_size(n: int, padded: int) -> None:
    assert CudagraphDispatcher(M.FULL, SIZES).padded_size(n) == padded


@pytest.mark.parametrize("n", [17, 25, 1000])
def test_no_padded_size_above_the_largest(n: int) -> None:
    assert CudagraphDispatcher(M.FULL, SIZES).padded_size(n) is None


@pytest.mark.parametrize("n, padded", PAD)
@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_uniform_decode_dispatch_pads_to_the_next_capture_size(
    mode: CUDAGraphMode, n: int, padded: int
) -> None:
    runtime_mode, key = CudagraphDispatcher(mode, SIZES).dispatch(_decode(n))
    expected_mode = mode.decode_mode()
    assert runtime_mode is expected_mode
    if expected_mode is R.NONE:
        assert key == _decode(n)  # eager runs unpadded
    elif mode is M.FULL:
        assert key == BatchDescriptor(padded, None, False)  # FULL's one graph per size
    elif expected_mode is R.FULL:
        assert key == _decode(padded)
    else:
        assert key == BatchDescriptor(padded, None, False)


@pytest.mark.parametrize(
    "num_tokens, num_reqs, padded", [(3, 1, 4), (7, 2, 8), (16, 5, 16), (9, 3, 16), (2, 1, 2)]
)
@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_mixed_batch_dispatch_per_mode(
    mode: CUDAGraphMode, num_tokens: int, num_reqs: int, padded: int
) -> None:
    runtime_mode, key = CudagraphDispatcher(mode, SIZES).dispatch(_mixed(num_tokens, num_reqs))
    assert runtime_mode is mode.mixed_mode()
    if runtime_mode is R.NONE:
        assert key == _mixed(num_tokens, num_reqs)
    else:
        assert key == BatchDescriptor(padded, None, False)


@pytest.mark.parametrize("n", [17, 25, 256])
@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
@pytest.mark.parametrize("uniform", [True, False], ids=["decode", "mixed"])
def test_batches_beyond_the_largest_size_run_eager_unpadded(
    mode: CUDAGraphMode, n: int, uniform: bool
) -> None:
    desc = _decode(n) if uniform else _mixed(n, 2)
    assert CudagraphDispatcher(mode, SIZES).dispatch(desc) == (R.NONE, desc)


@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_every_dispatched_graph_key_was_captured(mode: CUDAGraphMode) -> None:
    """Whatever the dispatcher asks to replay is a key it asked to capture."""
    d = CudagraphDispatcher(mode, SIZES)
    captured = set(d.all_keys())
    descs = [_decode(n) for n in range(1, 20)]
    descs += [_mixed(t, r) for t in range(2, 20) for r in range(1, t)]
    for desc in descs:
        runtime_mode, key = d.dispatch(desc)
        if runtime_mode is R.NONE:
            assert key == desc
        else:
            assert (runtime_mode, key) in captured
            assert key.num_tokens >= desc.num_tokens


def test_a_size_list_without_small_sizes_runs_small_batches_padded() -> None:
    d = CudagraphDispatcher(M.FULL_DECODE_ONLY, [8])
    assert d.dispatch(_decode(1)) == (R.FULL, _decode(8))
    assert d.dispatch(_decode(9)) == (R.NONE, _decode(9))


@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_decode_keys_stop_at_max_num_reqs_and_mixed_keys_do_not(mode: CUDAGraphMode) -> None:
    """A uniform decode batch has one token per request, so it never exceeds max_num_reqs;
    mixed keys count tokens and keep every size."""
    d = CudagraphDispatcher(mode, SIZES, max_num_reqs=4)
    if mode.decode_mode() is R.FULL and mode is not M.FULL:
        assert d.keys[R.FULL] == [_decode(n) for n in (1, 2, 4)]
    if mode.mixed_mode() is not R.NONE:
        assert [k.num_tokens for k in d.keys[mode.mixed_mode()]] == SIZES
    assert d.dispatch(_decode(3))[1].num_tokens == (3 if mode is M.NONE else 4)
    mixed_mode, key = d.dispatch(_mixed(12, 3))
    assert mixed_mode is mode.mixed_mode()
    assert key.num_tokens == (12 if mixed_mode is R.NONE else 16)


# ---------------------------------------------------------------- dynamic decode graph


@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_dynamic_decode_covers_uniform_batches_above_the_sizes_up_to_max_num_reqs(
    mode: CUDAGraphMode,
) -> None:
    """Only modes whose uniform decode has graphs of its own get the dynamic range: from
    the largest decode size + 1 to max_num_reqs, unpadded; mixed batches are unchanged."""
    d = CudagraphDispatcher(mode, SIZES, max_num_reqs=40, dynamic_decode=True)
    own_decode_graphs = mode.decode_mode() is R.FULL and mode is not M.FULL
    assert d.dynamic_decode_rows == ((17, 40) if own_decode_graphs else None)
    for n in (17, 25, 40):
        if own_decode_graphs:
            assert d.dispatch(_decode(n)) == (R.FULL, _decode(n))
        else:
            assert d.dispatch(_decode(n)) == CudagraphDispatcher(mode, SIZES, 40).dispatch(
                _decode(n)
            )
    # Fixed sizes still pad; mixed batches never take the dynamic graph.
    if own_decode_graphs:
        assert d.dispatch(_decode(5)) == (R.FULL, _decode(8))
    assert d.dispatch(_mixed(20, 3)) == CudagraphDispatcher(mode, SIZES, 40).dispatch(_mixed(20, 3))
    assert not d.covers_dynamic(16) and not d.covers_dynamic(41)
    # Its key is none the dispatcher asks to capture at a fixed size.
    assert all(k.num_tokens <= 16 or not k.uniform for _, k in d.all_keys())


def test_dynamic_decode_needs_rows_above_the_sizes_and_at_least_two() -> None:
    assert CudagraphDispatcher(M.FULL_DECODE_ONLY, SIZES, 16, True).dynamic_decode_rows is None
    assert CudagraphDispatcher(M.FULL_DECODE_ONLY, SIZES, 17, True).dynamic_decode_rows == (
        17,
        17,
    )
    # No decode size at or below max_num_reqs: from 2 (one row stays eager).
    d = CudagraphDispatcher(M.FULL_DECODE_ONLY, [64], 32, True)
    assert d.dynamic_decode_rows == (2, 32)
    assert d.dispatch(_decode(1)) == (R.NONE, _decode(1))
    assert CudagraphDispatcher(M.FULL_DECODE_ONLY, SIZES, 40).dynamic_decode_rows is None


def test_a_deferred_decode_size_pads_no_batch_until_made() -> None:
    """Until a deferred size's graph is made, its batches pad to the smallest larger size
    that is made, or run eagerly; mixed batches keep their piecewise keys."""
    d = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [1, 4, 8], max_num_reqs=8)
    d.defer_decode_sizes([4, 8])
    assert d.made_decode_sizes == [1]
    assert d.dispatch(_decode(1)) == (R.FULL, _decode(1))
    # No full decode graph above 1 yet: the mixed mode's piecewise graph takes it.
    assert d.dispatch(_decode(3)) == (R.PIECEWISE, BatchDescriptor(4, None, False))
    assert d.planned_decode_size(3) == 4 and d.padded_decode_size(3) is None
    d.decode_size_made(8)
    assert d.dispatch(_decode(3)) == (R.FULL, _decode(8))  # the larger made size
    d.decode_size_made(4)
    assert d.made_decode_sizes == [1, 4, 8]
    assert d.dispatch(_decode(3)) == (R.FULL, _decode(4))
    assert d.dispatch(_mixed(6, 2)) == (R.PIECEWISE, BatchDescriptor(8, None, False))


def test_a_deferred_decode_size_runs_eagerly_where_no_larger_graph_is_made() -> None:
    d = CudagraphDispatcher(M.FULL_DECODE_ONLY, [1, 4, 8], max_num_reqs=8)
    d.defer_decode_sizes([4, 8])
    assert d.dispatch(_decode(2)) == (R.NONE, _decode(2))
    assert d.dispatch(_decode(8)) == (R.NONE, _decode(8))
    d.decode_size_made(3)  # not a capture size: nothing changes
    assert d.made_decode_sizes == [1]
