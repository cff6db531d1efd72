"""InputBatch: what a step writes into the persistent buffers, padding included
(docs/design.md §5), and the dummy batches of capture and profiling."""

from __future__ import annotations

import pytest
import torch

from decodegraph.forward_context import BatchDescriptor
from decodegraph.graphs.modes import RuntimeMode
from decodegraph.sampling_params import SamplingParams
from decodegraph.worker.input_batch import InputBatch
from decodegraph.worker.input_buffers import InputBuffers
from decodegraph.worker.request_state import CachedRequestState

BS = 4  # block size


def _buffers(max_tokens: int = 16, max_reqs: int = 6) -> InputBuffers:
    return InputBuffers(max_tokens, max_reqs, 8, BS, torch.device("cpu"))


def _state(req_id: str, tokens: list[int], computed: int, blocks: list[int]) -> CachedRequestState:
    return CachedRequestState(
        req_id,
        tokens,
        SamplingParams(),
        None,
        None,
        (blocks,),
        computed,
        all_token_ids=list(tokens),
    )


def test_prepare_writes_tokens_positions_slots_and_pads_a_uniform_key() -> None:
    b = _buffers()
    # A decode at position 5 (block 2, offset 1) and one at position 0 of block 3.
    states = [_state("a", [1, 2, 3, 4, 5, 6], 5, [1, 2]), _state("b", [7], 0, [3])]
    key = BatchDescriptor(4, 4, True)
    batch = InputBatch.prepare(["a", "b"], states, [1, 1], RuntimeMode.FULL, key, b)
    assert b.input_ids.np[:4].tolist() == [6, 7, 0, 0]
    assert b.positions.np[:4].tolist() == [5, 0, 0, 0]
    assert b.slot_mapping.np[:4].tolist() == [2 * BS + 1, 3 * BS, -1, -1]
    assert b.seq_lens.np[:4].tolist() == [6, 1, 0, 0]
    assert b.query_start_loc.np[:5].tolist() == [0, 1, 2, 2, 2]
    assert b.block_tables.np[:2, :2].tolist() == [[1, 2], [3, 0]]
    assert (batch.num_reqs, batch.num_tokens) == (2, 2)
    assert (batch.num_reqs_after_padding, batch.num_tokens_after_padding) == (4, 4)
    assert batch.uniform_decode and batch.sample_rows == [0, 1]
    assert batch.seq_lens_cpu == [6, 1] and batch.max_seq_len == 6
    # The runner's states now count this step's tokens as computed.
    assert [s.num_computed_tokens for s in states] == [6, 1]


def test_a_partial_prefill_chunk_does_not_sample_and_a_mixed_full_key_spans_every_row() -> None:
    b = _buffers()
    states = [_state("p", list(range(10, 20)), 2, [5, 6, 7]), _state("d", [1, 2], 1, [4])]
    key = BatchDescriptor(8, None, False)
    batch = InputBatch.prepare(["p", "d"], states, [4, 1], RuntimeMode.FULL, key, b)
    assert b.input_ids.np[:5].tolist() == [12, 13, 14, 15, 2]
    assert b.slot_mapping.np[:8].tolist() == [22, 23, 24, 25, 17, -1, -1, -1]
    assert batch.sample_rows == [1]  # p computes tokens 2-5 of 10: no sample yet
    assert batch.num_reqs_after_padding == b.max_num_reqs
    assert b.query_start_loc.np[: b.max_num_reqs + 1].tolist() == [0, 4, 5, 5, 5, 5, 5]
    assert b.logits_indices.np[:2].tolist() == [3, 4]
    md = batch.attention_metadata(b)
    assert md.seq_lens.shape == (b.max_num_reqs,) and md.slot_mapping.shape == (8,)
    assert md.query_start_loc_cpu == [0, 4, 5] and md.num_actual_tokens == 5


def test_a_request_that_moved_rows_gets_its_block_row_rewritten() -> None:
    b = _buffers()
    a, c = _state("a", [1, 2], 1, [1]), _state("c", [3, 4, 5], 1, [2, 3])
    none = BatchDescriptor(2, 2, True)
    InputBatch.prepare(["a", "c"], [a, c], [1, 1], RuntimeMode.NONE, none, b)
    InputBatch.prepare(["c"], [c], [1], RuntimeMode.NONE, BatchDescriptor(1, 1, True), b)
    assert b.block_tables.np[0, :2].tolist() == [2, 3]


def test_a_large_decode_batch_writes_every_row_and_group() -> None:
    """Enough decode rows to be gathered in lists first (input_batch's
    _DECODE_ROWS_AS_LISTS), over two KV cache groups: each row's token, position, slot in
    each group, context length, query start and logits row, and every block-table row;
    the next step, after rows moved and one request gained a block, rewrites exactly those
    rows."""
    n = 10
    b = InputBuffers(16, 12, 8, BS, torch.device("cpu"), num_kv_groups=2)

    def state(i: int, computed: int) -> CachedRequestState:
        tokens = [100 + i * 10 + t for t in range(computed + 1)]
        blocks = [1 + 3 * i + k for k in range(computed // BS + 1)]
        s = _state(f"r{i}", tokens, computed, blocks)
        s.block_ids = (blocks, [200 + b for b in blocks])
        return s

    def expect(states: list[CachedRequestState], firsts: list[int]) -> None:
        assert b.input_ids.np[:n].tolist() == [
            s.all_token_ids[f] for s, f in zip(states, firsts, strict=True)
        ]
        assert b.positions.np[:n].tolist() == firsts
        for g in range(2):
            want = [
                s.block_ids[g][f // BS] * BS + f % BS for s, f in zip(states, firsts, strict=True)
            ]
            assert b.kv_groups[g].slot_mapping.np[:n].tolist() == want
            for row, s in enumerate(states):
                ids = s.block_ids[g]
                assert b.kv_groups[g].block_table.np[row, : len(ids)].tolist() == ids
                assert not b.kv_groups[g].block_table.np[row, len(ids) :].any()
        assert b.seq_lens.np[:n].tolist() == [f + 1 for f in firsts]
        assert b.query_start_loc.np[: n + 1].tolist() == list(range(n + 1))
        assert b.logits_indices.np[:n].tolist() == list(range(n))

    states = [state(i, 2 + i) for i in range(n)]
    key = BatchDescriptor(n, n, True)
    batch = InputBatch.prepare(
        [s.req_id for s in states], states, [1] * n, RuntimeMode.NONE, key, b
    )
    expect(states, [2 + i for i in range(n)])
    assert batch.seq_lens_cpu == [3 + i for i in range(n)] and batch.max_seq_len == n + 2
    assert batch.sample_rows == list(range(n))
    assert batch.query_start_loc_cpu == list(range(n + 1))
    # The next step: rows 0 and 1 swap places; the requests whose next position starts
    # a block (requests 1, 5 and 9: positions 4, 8 and 12) gained one in each group.
    states[0], states[1] = states[1], states[0]
    grown = []
    for s in states:
        s.all_token_ids.append(7)
        if s.num_computed_tokens % BS == 0:
            s.block_ids[0].append(90 + len(grown))
            s.block_ids[1].append(290 + len(grown))
            grown.append(s.req_id)
    assert grown == ["r1", "r5", "r9"]
    batch = InputBatch.prepare(
        [s.req_id for s in states], states, [1] * n, RuntimeMode.NONE, key, b
    )
    expect(states, [4, 3] + [3 + i for i in range(2, n)])
    assert b.slot_mapping.np[0] == 90 * BS and b.kv_groups[1].slot_mapping.np[5] == 291 * BS


@pytest.mark.parametrize("extra", [0, 8], ids=["2 rows", "10 rows"])
def test_advance_writes_what_prepare_writes_for_the_next_decode_step(extra: int) -> None:
    """A multi-step batch's later step (InputBatch.advance) leaves the buffers and host
    values as a fresh prepare() of that step would, across a block boundary and with a
    padded uniform key; the states advance alike. With 10 rows, written from lists."""

    def decode_states() -> list[CachedRequestState]:
        # Positions 3 and 7 now: the next step's tokens start blocks 2 and 5 (4 slots
        # each), which the first step's delta brought. The extra rows stay in a block.
        return [
            _state("a", [1, 2, 3, 4], 3, [1, 2]),
            _state("b", list(range(8)), 7, [3, 4, 5]),
            *(_state(f"x{i}", [20 + i] * 5, 4, [10 + i, 30 + i]) for i in range(extra)),
        ]

    n = 2 + extra
    key = BatchDescriptor(n + 2, n + 2, True)
    advanced, fresh = _buffers(n + 2, n + 2), _buffers(n + 2, n + 2)
    states = decode_states()
    ids = [s.req_id for s in states]
    tokens = [9, 8] + [40 + i for i in range(extra)]
    first = InputBatch.prepare(ids, states, [1] * n, RuntimeMode.FULL, key, advanced)
    for s, token in zip(states, tokens, strict=True):
        s.append_output_token(token)
    batch = first.advance(states, advanced)
    again = decode_states()
    for s, token in zip(again, tokens, strict=True):
        s.num_computed_tokens += 1
        s.append_output_token(token)
    want = InputBatch.prepare(ids, again, [1] * n, RuntimeMode.FULL, key, fresh)
    assert batch == want
    assert [s.num_computed_tokens for s in states] == [s.num_computed_tokens for s in again]
    for name in ("input_ids", "positions", "seq_lens", "query_start_loc", "logits_indices"):
        assert getattr(advanced, name).np.tolist() == getattr(fresh, name).np.tolist(), name
    assert advanced.slot_mapping.np.tolist() == fresh.slot_mapping.np.tolist()
    assert advanced.block_tables.np.tolist() == fresh.block_tables.np.tolist()
    assert advanced.input_ids.np[:n].tolist() == tokens  # the tokens sampled last step
    assert advanced.slot_mapping.np[:2].tolist() == [2 * BS, 5 * BS]
    assert advanced.slot_mapping.np[2:n].tolist() == [(30 + i) * BS + 1 for i in range(extra)]


def _two_group_decode_states(extra: int) -> list[CachedRequestState]:
    """Decodes at positions 3, 7 and 4 (x rows): a's and b's next tokens start a block."""
    states = [
        _state("a", [1, 2, 3, 4], 3, [1]),
        _state("b", list(range(8)), 7, [3, 4]),
        *(_state(f"x{i}", [20 + i] * 5, 4, [10 + i, 30 + i]) for i in range(extra)),
    ]
    for s in states:
        s.block_ids = (s.block_ids[0], [100 + b for b in s.block_ids[0]])
    return states


def _sample_and_grow(states: list[CachedRequestState], tokens: list[int]) -> None:
    """The step's sampled tokens appended, and the scheduler's next delta: a and b (rows 0
    and 1) given their next block in both groups."""
    for s, token in zip(states, tokens, strict=True):
        s.append_output_token(token)
    for s, block in ((states[0], 2), (states[1], 5)):
        s.block_ids[0].append(block)
        s.block_ids[1].append(100 + block)


@pytest.mark.parametrize("extra", [6, 8], ids=["8 rows", "10 rows"])
def test_next_decode_writes_what_prepare_writes_for_the_next_step(extra: int) -> None:
    """A decode batch one step on in place (InputBatch.next_decode) leaves the buffers and
    host values as a fresh prepare() of that step would: over two KV cache groups, with a
    padded uniform key, where two requests start a block (their rows rewritten from the
    delta); the states advance alike. Twice: the second step goes on from the first."""
    n = 2 + extra
    key = BatchDescriptor(n + 2, n + 2, True)

    def buffers() -> InputBuffers:
        return InputBuffers(n + 2, n + 2, 8, BS, torch.device("cpu"), num_kv_groups=2)

    in_place = buffers()
    states = _two_group_decode_states(extra)
    ids = [s.req_id for s in states]
    batch = InputBatch.prepare(ids, states, [1] * n, RuntimeMode.FULL, key, in_place)
    history = [[9, 8] + [40 + i for i in range(extra)], [7, 6] + [60 + i for i in range(extra)]]
    for step, tokens in enumerate(history):
        assert batch.continues_in_place(ids, RuntimeMode.FULL, key, in_place)
        if step == 0:
            _sample_and_grow(states, tokens)
            batch = batch.next_decode(states, tokens, [0, 1], in_place)
        else:
            for s, token in zip(states, tokens, strict=True):
                s.append_output_token(token)
            batch = batch.next_decode(states, tokens, [], in_place)
        fresh = buffers()
        again = _two_group_decode_states(extra)
        for earlier, tokens_then in enumerate(history[: step + 1]):
            for s in again:
                s.num_computed_tokens += 1
            if earlier == 0:
                _sample_and_grow(again, tokens_then)
            else:
                for s, token in zip(again, tokens_then, strict=True):
                    s.append_output_token(token)
        want = InputBatch.prepare(ids, again, [1] * n, RuntimeMode.FULL, key, fresh)
        assert batch == want
        assert (
            batch.positions.tolist()
            == want.positions.tolist()
            == [s.num_computed_tokens - 1 for s in again]
        )
        assert [s.num_computed_tokens for s in states] == [s.num_computed_tokens for s in again]
        for name in ("input_ids", "positions", "seq_lens", "query_start_loc", "logits_indices"):
            assert getattr(in_place, name).np.tolist() == getattr(fresh, name).np.tolist(), name
        for g in range(2):
            got, exp = in_place.kv_groups[g], fresh.kv_groups[g]
            assert got.slot_mapping.np.tolist() == exp.slot_mapping.np.tolist()
            assert got.block_table.np.tolist() == exp.block_table.np.tolist()
        assert in_place.input_ids.np[:n].tolist() == tokens  # the tokens sampled last step
    # a's and b's positions 5 and 9: the blocks the delta brought, one slot in.
    assert in_place.kv_groups[0].slot_mapping.np[:2].tolist() == [2 * BS + 1, 5 * BS + 1]
    assert in_place.kv_groups[1].slot_mapping.np[:2].tolist() == [102 * BS + 1, 105 * BS + 1]


def test_a_decode_batch_goes_on_in_place_only_from_the_buffers_as_it_left_them() -> None:
    """Not after another write into the buffers (a dummy batch of capture or of a graph
    made in the background), nor under another key or mode, nor with other requests or
    another order; never a batch with a row that does not sample, nor one of fewer rows
    than input_batch's _DECODE_ROWS_AS_LISTS (a value at a time is quicker there)."""
    b = _buffers(16, 12)

    def decodes(n: int) -> list[CachedRequestState]:
        return [_state(f"r{i}", [1, 2, 3], 2, [1 + i]) for i in range(n)]

    ids = [f"r{i}" for i in range(8)]
    key = BatchDescriptor(8, 8, True)
    batch = InputBatch.prepare(ids, decodes(8), [1] * 8, RuntimeMode.FULL, key, b)
    assert batch.continues_in_place(ids, RuntimeMode.FULL, key, b)
    assert not batch.continues_in_place(ids[::-1], RuntimeMode.FULL, key, b)
    assert not batch.continues_in_place(ids[:7], RuntimeMode.FULL, key, b)
    assert not batch.continues_in_place(ids, RuntimeMode.NONE, key, b)
    assert not batch.continues_in_place(ids, RuntimeMode.FULL, BatchDescriptor(16, 16, True), b)
    InputBatch.make_dummy(2, 2, True, b)
    assert not batch.continues_in_place(ids, RuntimeMode.FULL, key, b)
    # Seven decodes: prepare's own loop.
    small = InputBatch.prepare(ids[:7], decodes(7), [1] * 7, RuntimeMode.FULL, key, b)
    assert small.positions is None
    # A prompt's last-but-one token among decodes: one token a row, but no sample there.
    chunk = _state("p", list(range(10, 20)), 8, [5, 6, 7])
    mixed = InputBatch.prepare(
        [*ids[:7], "p"], [*decodes(7), chunk], [1] * 8, RuntimeMode.FULL, key, b
    )
    assert mixed.sample_rows == list(range(7)) and mixed.positions is None
    assert not mixed.continues_in_place([*ids[:7], "p"], RuntimeMode.FULL, key, b)


def test_make_dummy_writes_one_token_requests_at_length_one_into_the_null_block() -> None:
    b = _buffers()
    b.slot_mapping.np[:] = 9
    batch = InputBatch.make_dummy(3, 3, True, b, RuntimeMode.FULL)
    assert b.slot_mapping.np[:3].tolist() == [0, 0, 0]  # the reserved null block
    assert b.seq_lens.np[:3].tolist() == [1, 1, 1]
    assert batch.max_seq_len == 1 and batch.seq_lens_cpu == [1, 1, 1]
    assert batch.batch_descriptor == BatchDescriptor(3, 3, True)
    md = batch.attention_metadata(b)
    assert md.num_reqs == 3 and md.block_tables.shape[0] == 3


def test_make_dummy_of_a_mixed_key_leaves_padding_and_spans_every_row() -> None:
    b = _buffers()
    batch = InputBatch.make_dummy(1, 8, False, b, RuntimeMode.PIECEWISE)
    assert b.slot_mapping.np[:8].tolist() == [0] + [-1] * 7
    assert b.query_start_loc.np[: b.max_num_reqs + 1].tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert batch.num_reqs_after_padding == b.max_num_reqs and batch.num_tokens == 1


def test_the_profiling_dummy_has_no_requests_and_writes_no_slot() -> None:
    b = _buffers()
    batch = InputBatch.make_dummy(0, 16, False, b)
    assert (b.slot_mapping.np[:16] == -1).all()
    md = batch.attention_metadata(b)
    assert md.num_reqs == 0 and md.num_actual_tokens == 0


class _RecordingEvent:
    """Stands in for a device event; logs each call with what the host ids held then."""

    def __init__(self) -> None:
        self.buffers: InputBuffers | None = None
        self.log: list[tuple[str, list[int]]] = []

    def _ids(self) -> list[int]:
        assert self.buffers is not None
        return self.buffers.input_ids.np[:2].tolist()

    def record(self) -> None:
        self.log.append(("record", self._ids()))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self._ids()))


def _device_buffers(event: _RecordingEvent, max_reqs: int = 6) -> InputBuffers:
    """Buffers whose device side is not the host side (meta tensors: copies do nothing)."""
    b = InputBuffers(16, max_reqs, 8, BS, torch.device("meta"), copy_event=event)
    event.buffers = b
    return b


def test_the_host_arrays_are_written_only_after_the_last_copy_read_them() -> None:
    """Two steps that sample nothing (prefill chunks): the second waits on the event the
    first recorded after its copies, before it writes a single host value."""
    event = _RecordingEvent()
    b = _device_buffers(event)
    state = _state("p", list(range(10, 20)), 0, [5, 6, 7])
    key = BatchDescriptor(2, None, False)
    for _ in range(2):
        batch = InputBatch.prepare(["p"], [state], [2], RuntimeMode.NONE, key, b)
        assert batch.sample_rows == []
    assert event.log == [("record", [10, 11]), ("synchronize", [10, 11]), ("record", [12, 13])]


def test_a_step_after_a_synchronised_one_does_not_wait_again() -> None:
    event = _RecordingEvent()
    b = _device_buffers(event)
    InputBatch.make_dummy(1, 1, True, b)
    b.wait_for_copies()
    InputBatch.make_dummy(1, 1, True, b)
    assert [name for name, _ in event.log] == ["record", "synchronize", "record"]


def test_a_mixed_full_key_copies_the_block_rows_of_its_requests_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its metadata spans every request row, but rows past the batch are never read:
    one block-table row per request crosses to the device, not max_num_seqs."""
    b = _device_buffers(_RecordingEvent(), max_reqs=6)
    copied: list[int] = []
    table = b.kv_groups[0].block_table
    monkeypatch.setattr(table, "copy_to_device", copied.append)
    states = [_state("p", list(range(10, 20)), 2, [5, 6, 7]), _state("d", [1, 2], 1, [4])]
    batch = InputBatch.prepare(
        ["p", "d"], states, [4, 1], RuntimeMode.FULL, BatchDescriptor(8, None, False), b
    )
    assert batch.num_reqs_after_padding == 6
    assert copied == [2]
