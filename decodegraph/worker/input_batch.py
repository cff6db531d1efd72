"""What one step feeds the model (`InputBatch`), and how a step writes it.

`InputBatch.prepare` writes a scheduled batch into the persistent buffers and returns
the host values that go with them; `InputBatch.make_dummy` does the same for the capture
and profiling batches. Both follow the padding convention of docs/design.md §5. A decode
batch whose requests all decode again, in the same rows under the same key, goes one step
on in place (`InputBatch.next_decode`): only what a step changes is written, as arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from decodegraph.attention.backends.base import AttentionMetadata
from decodegraph.forward_context import BatchDescriptor
from decodegraph.graphs.modes import RuntimeMode
from decodegraph.worker.input_buffers import BlockTable, InputBuffers
from decodegraph.worker.request_state import CachedRequestState

# From this many decode rows on, a step writes them an array at a time: gathered in
# lists (_write_decode_rows), or from the last step's arrays in place (next_decode);
# below it, a value at a time is quicker.
_DECODE_ROWS_AS_LISTS = 8


@dataclass(slots=True)
class InputBatch:
    """One step's batch, host side. The model reads its tensors from the persistent
    buffers (`InputBuffers`), which the step wrote first; these are the host values
    that go with them, and what the graph runner dispatched it to."""

    # [num_reqs] the requests' ids, in batch order.
    req_ids: list[str]
    # Requests in the batch (padded rows excluded).
    num_reqs: int
    # Tokens the requests compute (padded rows excluded).
    num_tokens: int
    # Request rows the attention metadata spans: num_reqs, a uniform graph's size, or
    # every row (max_num_seqs) for a mixed full graph.
    num_reqs_after_padding: int
    # Token rows the model runs: the graph key's size, or num_tokens when eager.
    num_tokens_after_padding: int
    # The most tokens one request computes.
    max_query_len: int
    # The longest context in the batch, this step's tokens included.
    max_seq_len: int
    # Every request computes exactly one token.
    uniform_decode: bool
    # [num_reqs + 1] where each request's tokens start in the batch, then the total.
    query_start_loc_cpu: list[int]
    # [num_reqs] each request's context length after this step.
    seq_lens_cpu: list[int]
    # [num_sampling] batch rows whose request reaches its last token and samples.
    sample_rows: list[int]
    # What runs this batch and under which key (the dispatcher's answer).
    runtime_mode: RuntimeMode
    batch_descriptor: BatchDescriptor
    # A decode batch of _DECODE_ROWS_AS_LISTS rows or more whose every row samples: each
    # row's position, and the buffers' write count once it was written
    # (InputBuffers.writes); what next_decode goes on from. None for any other batch.
    positions: np.ndarray | None = field(default=None, compare=False)
    written: int = field(default=-1, compare=False)

    @classmethod
    def make_dummy(
        cls,
        num_reqs: int,
        num_tokens: int,
        uniform: bool,
        buffers: InputBuffers,
        runtime_mode: RuntimeMode = RuntimeMode.NONE,
    ) -> InputBatch:
        """A batch of `num_reqs` dummy requests of one token each at context length 1,
        run over `num_tokens` rows (the rest padding), written into `buffers`.

        Graph capture uses it (docs/design.md §9: capture with lengths of 1, workspaces
        sized for max_model_len); its K/V go to the reserved null block 0. With
        `num_reqs=0` (the profiling run) nothing is attended or written. A mixed
        (`uniform=False`) batch's metadata spans every request row, as a mixed full
        graph's does.
        """
        if uniform and num_reqs != num_tokens:
            raise ValueError(f"a uniform dummy batch has one token per request, not {num_tokens}")
        views = num_reqs if uniform else buffers.max_num_reqs
        b = buffers
        b.wait_for_copies()
        b.input_ids.np[:num_tokens] = 0
        b.positions.np[:num_tokens] = 0
        for table in b.kv_groups:
            table.slot_mapping.np[:num_reqs] = 0
            table.slot_mapping.np[num_reqs:num_tokens] = -1
        b.seq_lens.np[:num_reqs] = 1
        b.seq_lens.np[num_reqs:views] = 0
        b.query_start_loc.np[: num_reqs + 1] = np.arange(num_reqs + 1)
        b.query_start_loc.np[num_reqs + 1 : views + 1] = num_reqs
        b.clear_block_rows(0, views)
        b.copy_to_device(num_tokens, views, num_reqs)
        b.num_reqs_np[0] = num_reqs
        b.writes += 1
        key = BatchDescriptor(num_tokens, num_tokens if uniform else None, uniform)
        return cls(
            req_ids=[f"dummy-{i}" for i in range(num_reqs)],
            num_reqs=num_reqs,
            num_tokens=num_reqs,
            num_reqs_after_padding=views,
            num_tokens_after_padding=num_tokens,
            max_query_len=1 if num_reqs else 0,
            max_seq_len=1 if num_reqs else 0,
            uniform_decode=uniform,
            query_start_loc_cpu=list(range(num_reqs + 1)),
            seq_lens_cpu=[1] * num_reqs,
            sample_rows=list(range(num_reqs)),
            runtime_mode=runtime_mode,
            batch_descriptor=key,
        )

    @classmethod
    def prepare(
        cls,
        req_ids: list[str],
        states: list[CachedRequestState],
        num_scheduled_tokens: list[int],
        runtime_mode: RuntimeMode,
        key: BatchDescriptor,
        buffers: InputBuffers,
    ) -> InputBatch:
        """Write a scheduled batch into `buffers` (host side first, then one copy to the
        device), padded as the dispatcher's `runtime_mode` and `key` say. Request `i`
        computes `num_scheduled_tokens[i]` tokens from its `num_computed_tokens` on, which
        this advances past them."""
        b = buffers
        counts = num_scheduled_tokens
        num_reqs, num_tokens = len(states), sum(counts)
        uniform = num_tokens == num_reqs
        padded_tokens = key.num_tokens
        if key.uniform:
            padded_reqs = key.num_reqs
        elif runtime_mode is RuntimeMode.FULL:
            # A mixed graph's metadata spans every request row (captured so): rows past
            # this batch must read as empty to kernels that search them on the device.
            padded_reqs = b.max_num_reqs
        else:
            padded_reqs = num_reqs
        b.wait_for_copies()
        seq_lens_cpu, sample_rows = _write_rows(b, states, counts)
        # Padding (docs/design.md §5) and stale tails.
        if padded_tokens > num_tokens:
            b.input_ids.np[num_tokens:padded_tokens] = 0
            b.positions.np[num_tokens:padded_tokens] = 0
            for table in b.kv_groups:
                table.slot_mapping.np[num_tokens:padded_tokens] = -1
        if padded_reqs > num_reqs:
            b.seq_lens.np[num_reqs:padded_reqs] = 0
            b.query_start_loc.np[num_reqs + 1 : padded_reqs + 1] = num_tokens
            b.clear_block_rows(num_reqs, padded_reqs)
        b.copy_to_device(padded_tokens, padded_reqs, num_reqs)
        b.num_reqs_np[0] = num_reqs
        b.writes += 1
        decodes = uniform and len(sample_rows) == num_reqs >= _DECODE_ROWS_AS_LISTS
        return cls(
            req_ids=req_ids,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            num_reqs_after_padding=padded_reqs,
            num_tokens_after_padding=padded_tokens,
            max_query_len=max(counts),
            max_seq_len=max(seq_lens_cpu),
            uniform_decode=uniform,
            query_start_loc_cpu=(
                [0, 1]
                if num_reqs == 1 and num_tokens == 1
                else b.query_start_loc.np[: num_reqs + 1].tolist()
            ),
            seq_lens_cpu=seq_lens_cpu,
            sample_rows=sample_rows,
            runtime_mode=runtime_mode,
            batch_descriptor=key,
            positions=b.positions.np[:num_reqs].copy() if decodes else None,
            written=b.writes,
        )

    def advance(self, states: list[CachedRequestState], buffers: InputBuffers) -> InputBatch:
        """The next step of a multi-step batch, written into `buffers`: the same rows,
        each request computing the one token it sampled last step. Every row is written
        as prepare() writes it (the query starts, logits rows and block-table rows to what
        they hold already: the block tables hold every step's blocks), and the padding
        stays."""
        b = buffers
        b.wait_for_copies()
        seq_lens_cpu, _ = _write_rows(b, states, [1] * self.num_reqs)
        b.copy_to_device(self.num_tokens_after_padding, self.num_reqs_after_padding, self.num_reqs)
        b.writes += 1
        return self._one_token_on(seq_lens_cpu)

    def continues_in_place(
        self,
        req_ids: list[str],
        runtime_mode: RuntimeMode,
        key: BatchDescriptor,
        buffers: InputBuffers,
    ) -> bool:
        """Whether the next step's batch can be this one a token on (`next_decode`): this
        is a decode batch of `_DECODE_ROWS_AS_LISTS` rows or more whose every row sampled,
        the buffers hold it as it wrote them (nothing wrote them since), and the next step
        runs the same requests in the same order under the same mode and key. The caller
        checks that each request decodes one token and none is new or resumed."""
        return (
            self.positions is not None
            and self.written == buffers.writes
            and runtime_mode is self.runtime_mode
            and key == self.batch_descriptor
            and req_ids == self.req_ids
        )

    def next_decode(
        self,
        states: list[CachedRequestState],
        token_ids: list[int],
        grown_rows: list[int],
        buffers: InputBuffers,
    ) -> InputBatch:
        """This batch one step on, written in place (where `continues_in_place`): each
        request computes the token it sampled last step (`token_ids`, in batch order), one
        position on. Only what a step changes is written, each array at once from the last
        step's positions: token ids, positions, slots (from the block-table rows) and
        context lengths, and the block-table rows of `grown_rows`, the requests given a
        block since; the query starts, logits rows and padding stay. The buffers end as
        prepare() would leave them, at a fraction of its cost for a large batch (a row at
        a time in Python, each request's objects out of the caches after a forward)."""
        b, n, bs = buffers, self.num_reqs, buffers.block_size
        b.wait_for_copies()
        positions = self.positions + 1
        b.input_ids.np[:n] = token_ids
        b.positions.np[:n] = positions
        rows, columns, offsets = b.arange[:n], positions // bs, positions % bs
        for g, table in enumerate(b.kv_groups):
            for i in grown_rows:
                table.write_row(i, states[i].block_ids[g])
            blocks = table.block_table.np[rows, columns].astype(np.int64)
            table.slot_mapping.np[:n] = blocks * bs + offsets
        seq_lens = positions + 1
        b.seq_lens.np[:n] = seq_lens
        for state in states:
            state.num_computed_tokens += 1  # this step computes it
        b.copy_to_device(self.num_tokens_after_padding, self.num_reqs_after_padding, n)
        b.writes += 1
        return self._one_token_on(seq_lens.tolist(), positions, b.writes)

    def _one_token_on(
        self, seq_lens_cpu: list[int], positions: np.ndarray | None = None, written: int = -1
    ) -> InputBatch:
        """This decode batch's host values one token on (advance, next_decode): the same
        rows, key and sampling rows, the new context lengths."""
        return InputBatch(
            self.req_ids,
            self.num_reqs,
            self.num_tokens,
            self.num_reqs_after_padding,
            self.num_tokens_after_padding,
            1,
            max(seq_lens_cpu),
            True,
            self.query_start_loc_cpu,
            seq_lens_cpu,
            self.sample_rows,
            self.runtime_mode,
            self.batch_descriptor,
            positions,
            written,
        )

    def attention_metadata(self, buffers: InputBuffers, group: int = 0) -> AttentionMetadata:
        """This batch's attention metadata over views of `buffers` for KV cache group
        `group` (the buffers' object for this shape, its host values set to this
        batch's)."""
        md = buffers.attention_metadata(
            self.num_reqs_after_padding, self.num_tokens_after_padding, group
        )
        md.num_reqs = self.num_reqs
        md.num_actual_tokens = self.num_tokens
        md.max_query_len = self.max_query_len
        md.max_seq_len = self.max_seq_len
        md.uniform_decode = self.uniform_decode
        md.query_start_loc_cpu = self.query_start_loc_cpu
        md.seq_lens_cpu = self.seq_lens_cpu
        return md


def _write_rows(
    b: InputBuffers, states: list[CachedRequestState], counts: list[int]
) -> tuple[list[int], list[int]]:
    """Any batch's token rows, context lengths, query starts, logits rows and block-table
    rows (`counts[i]` tokens of request `i` from its computed ones on, which this advances
    past them): the batch's context lengths, and the rows that sample. A value at a time;
    from _DECODE_ROWS_AS_LISTS decode rows on, gathered in lists (_write_decode_rows)."""
    if len(states) >= _DECODE_ROWS_AS_LISTS and sum(counts) == len(states):
        return _write_decode_rows(b, states)
    bs, kv_groups = b.block_size, b.kv_groups
    first_group = kv_groups[0]
    ids, pos, slots = b.input_ids.np, b.positions.np, first_group.slot_mapping.np
    write_row = first_group.write_row
    seq_lens, qsl, logits_idx = b.seq_lens.np, b.query_start_loc.np, b.logits_indices.np
    seq_lens_cpu: list[int] = []
    sample_rows: list[int] = []
    start = 0
    for i, (state, n) in enumerate(zip(states, counts, strict=True)):
        first = state.num_computed_tokens
        end = first + n
        block_ids = state.block_ids[0]
        tokens = state.all_token_ids
        if n == 1:
            ids[start] = tokens[first]
            pos[start] = first
            slots[start] = block_ids[first // bs] * bs + first % bs
        else:
            p = np.arange(first, end)
            ids[start : start + n] = tokens[first:end]
            pos[start : start + n] = p
            slots[start : start + n] = np.asarray(block_ids)[p // bs] * bs + p % bs
        state.num_computed_tokens = end  # this step computes them
        seq_lens[i] = end
        seq_lens_cpu.append(end)
        write_row(i, block_ids)
        start += n
        qsl[i + 1] = start
        logits_idx[i] = start - 1
        if end == len(tokens):
            sample_rows.append(i)
    for g in range(1, len(kv_groups)):  # the other KV cache groups' tables
        _write_group(kv_groups[g], g, states, counts, bs)
    return seq_lens_cpu, sample_rows


def _write_decode_rows(
    b: InputBuffers, states: list[CachedRequestState]
) -> tuple[list[int], list[int]]:
    """_write_rows where every request computes one token: its token id, position, slot
    and context length gathered in lists, each array written once (a numpy scalar store
    per value cost more than the rest of a row)."""
    bs, n = b.block_size, len(states)
    first_group = b.kv_groups[0]
    owners, lengths, write_row = (
        first_group.row_owner,
        first_group.row_blocks,
        first_group.write_row,
    )
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    for i, state in enumerate(states):
        first = state.num_computed_tokens
        tokens = state.all_token_ids
        block_ids = state.block_ids[0]
        token_ids.append(tokens[first])
        positions.append(first)
        slots.append(block_ids[first // bs] * bs + first % bs)
        state.num_computed_tokens = first + 1  # this step computes it
        if owners[i] is not block_ids or lengths[i] != len(block_ids):  # (write_row's test)
            write_row(i, block_ids)
        if first + 1 == len(tokens):
            sample_rows.append(i)
    b.input_ids.np[:n] = token_ids
    b.positions.np[:n] = positions
    first_group.slot_mapping.np[:n] = slots
    seq_lens_cpu = [p + 1 for p in positions]
    b.seq_lens.np[:n] = seq_lens_cpu
    b.query_start_loc.np[1 : n + 1] = b.arange[1 : n + 1]
    b.logits_indices.np[:n] = b.arange[:n]
    for g in range(1, len(b.kv_groups)):  # the other KV cache groups' tables
        table = b.kv_groups[g]
        table.slot_mapping.np[:n] = [
            s.block_ids[g][p // bs] * bs + p % bs for s, p in zip(states, positions, strict=True)
        ]
        for i, state in enumerate(states):
            table.write_row(i, state.block_ids[g])
    return seq_lens_cpu, sample_rows


def _write_group(
    table: BlockTable,
    group: int,
    states: list[CachedRequestState],
    counts: list[int],
    bs: int,
) -> None:
    """Slots and block-table rows of KV cache group `group` (the first group's are written
    in prepare's main loop). Each state's computed tokens already count this step's."""
    slots = table.slot_mapping.np
    start = 0
    for i, (state, n) in enumerate(zip(states, counts, strict=True)):
        block_ids = state.block_ids[group]
        first = state.num_computed_tokens - n
        if n == 1:
            slots[start] = block_ids[first // bs] * bs + first % bs
        else:
            p = np.arange(first, first + n)
            slots[start : start + n] = np.asarray(block_ids)[p // bs] * bs + p % bs
        table.write_row(i, block_ids)
        start += n
