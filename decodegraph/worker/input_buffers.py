"""Persistent input buffers: allocated once at the largest size, written in place.

Graphs bind `[:n]` views of these at capture, so their addresses never change and a
replay reads whatever the step wrote (docs/design.md §1, "persistent buffers"). On CUDA
each buffer has a pinned host twin that the step writes with numpy and copies over in
one non-blocking copy; on CPU the host view *is* the buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from decodegraph.attention.backends.base import AttentionMetadata


class PersistentBuffer:
    """A device tensor plus the host array the step writes into."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, fill: int):
        self.device = device
        pin = device.type == "cuda"
        self.cpu = torch.full(shape, fill, dtype=dtype, pin_memory=pin)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else self.cpu.to(device)

    def copy_to_device(self, n: int) -> None:
        """Make the first n rows visible on the device."""
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class BlockTable:
    """One KV cache group's block tables and slot mapping (vLLM's name): the rows of the
    batch's requests, with the block list that wrote each row and how many columns."""

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        self.slot_mapping = PersistentBuffer((max_num_tokens,), torch.int64, device, -1)
        self.block_table = PersistentBuffer(
            (max_num_reqs, max_blocks_per_seq), torch.int32, device, 0
        )
        # Per row: the block list that wrote it (the runner's own list of one request's
        # blocks in this group) and how many columns: stale-tail clearing, and skipping
        # rewrites, since a decoding request's table changes once per block. The list
        # object, not the request id: an id may come back in a later request (a finished
        # one's, reused) and a preempted request resumes with a new list, so either
        # rewrites its row.
        # (Python lists: a step reads them per row, where a numpy scalar costs more.)
        self.row_blocks: list[int] = [0] * max_num_reqs
        self.row_owner: list[list[int] | None] = [None] * max_num_reqs

    def write_row(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        prev = self.row_blocks[row]
        if self.row_owner[row] is block_ids and prev == n:
            return  # a running request's blocks only grow at the tail: nothing changed
        bt = self.block_table.np
        bt[row, :n] = block_ids
        if prev > n:
            bt[row, n:prev] = 0
        self.row_blocks[row] = n
        self.row_owner[row] = block_ids

    def clear_rows(self, start: int, end: int) -> None:
        if any(self.row_blocks[start:end]):
            self.block_table.np[start:end] = 0
            self.row_blocks[start:end] = [0] * (end - start)
        self.row_owner[start:end] = [None] * (end - start)


class InputBuffers:
    """Every per-step model and attention input, with a `BlockTable` per KV cache group."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        num_kv_groups: int = 1,
        copy_event: Any = None,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        # Tokens per KV-cache block (slot = block * block_size + offset).
        self.block_size = block_size
        # Padding convention (docs/design.md §5): token 0, position 0, slot -1, length 0,
        # block 0 (block 0 is the reserved null block).
        self.input_ids = PersistentBuffer((max_num_tokens,), torch.int64, device, 0)
        self.positions = PersistentBuffer((max_num_tokens,), torch.int64, device, 0)
        self.seq_lens = PersistentBuffer((max_num_reqs,), torch.int32, device, 0)
        self.query_start_loc = PersistentBuffer((max_num_reqs + 1,), torch.int32, device, 0)
        self.logits_indices = PersistentBuffer((max_num_reqs,), torch.int64, device, 0)
        # 0, 1, 2, ...: a decode batch's query starts and logits rows, copied from here.
        self.arange = np.arange(max_num_reqs + 1, dtype=np.int64)
        self.kv_groups = [
            BlockTable(max_num_tokens, max_num_reqs, max_blocks_per_seq, device)
            for _ in range(num_kv_groups)
        ]
        # Batches written into these buffers so far (InputBatch's writers count them): a
        # decode batch goes on in place only from the buffers as it left them.
        self.writes = 0
        # The step's request count as a host tensor (read by native attention operators).
        self.num_reqs_host = torch.zeros(1, dtype=torch.int32)
        self.num_reqs_np = self.num_reqs_host.numpy()
        # (group, padded reqs, padded tokens) -> the attention metadata over views of
        # these buffers (made once per shape; a step rewrites its host values).
        self._metadata: dict[tuple[int, int, int], AttentionMetadata] = {}
        # On an accelerator: an event recorded after each step's host-to-device copies,
        # waited on before the host arrays are written again. A non-blocking copy from
        # pinned memory reads it when the device gets to it; a step that samples nothing
        # (a long prompt's chunk alone) never waits for the device otherwise, so the next
        # step's writes could land before the last copy read them (vLLM #35137, #32799).
        if copy_event is None and device.type != "cpu":
            copy_event = torch.Event(device)
        self._copy_done = copy_event
        self._copy_pending = False

    @property
    def slot_mapping(self) -> PersistentBuffer:
        """The first KV cache group's slot mapping."""
        return self.kv_groups[0].slot_mapping

    @property
    def block_tables(self) -> PersistentBuffer:
        """The first KV cache group's block tables."""
        return self.kv_groups[0].block_table

    def attention_metadata(
        self, num_reqs: int, num_tokens: int, group: int = 0
    ) -> AttentionMetadata:
        """The metadata over views for a batch padded to `num_reqs` request rows and
        `num_tokens` tokens, for KV cache group `group`: one object per shape, whose host
        values each step sets (InputBatch.attention_metadata). A graph's params are
        copies of it."""
        md = self._metadata.get((group, num_reqs, num_tokens))
        if md is None:
            table = self.kv_groups[group]
            md = self._metadata[(group, num_reqs, num_tokens)] = AttentionMetadata(
                num_reqs=0,
                num_actual_tokens=0,
                max_query_len=0,
                max_seq_len=0,
                uniform_decode=False,
                query_start_loc_cpu=[0],
                seq_lens_cpu=[],
                query_start_loc=self.query_start_loc.gpu[: num_reqs + 1],
                seq_lens=self.seq_lens.gpu[:num_reqs],
                block_tables=table.block_table.gpu[:num_reqs],
                slot_mapping=table.slot_mapping.gpu[:num_tokens],
                seq_lens_host=self.seq_lens.cpu[:num_reqs],
                num_reqs_host=self.num_reqs_host,
                query_start_loc_host=self.query_start_loc.cpu[: num_reqs + 1],
            )
        return md

    def clear_block_rows(self, start: int, end: int) -> None:
        """Padded rows point at the null block only, in every group."""
        for table in self.kv_groups:
            table.clear_rows(start, end)

    def wait_for_copies(self) -> None:
        """Before writing the host arrays: the last step's copies have read them."""
        if self._copy_pending:
            self._copy_done.synchronize()
            self._copy_pending = False

    def copy_to_device(self, num_tokens: int, num_reqs: int, num_table_rows: int) -> None:
        """Make the step's rows visible on the device: `num_tokens` token rows,
        `num_reqs` request rows, and the block tables of the first `num_table_rows`
        requests (rows past the batch have length 0 and are never read)."""
        if self._copy_done is None:
            return  # CPU: the host arrays are the buffers
        for buf in (self.input_ids, self.positions):
            buf.copy_to_device(num_tokens)
        for buf in (self.seq_lens, self.logits_indices):
            buf.copy_to_device(num_reqs)
        for table in self.kv_groups:
            table.slot_mapping.copy_to_device(num_tokens)
            table.block_table.copy_to_device(num_table_rows)
        self.query_start_loc.copy_to_device(num_reqs + 1)
        self._copy_done.record()
        self._copy_pending = True
