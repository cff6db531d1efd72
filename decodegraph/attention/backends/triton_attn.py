"""Paged attention in Triton kernels: the CUDA backend (TRITON_ATTN).

Each layer's step launches `_write_kv`, then one of two attention kernels, then (when
the batch is split) `_reduce_segments`:

- `_write_kv` stores this step's K/V rows at their cache slots (slot -1 writes nothing)
  and zeroes the output rows of padding tokens, so no attention kernel writes those.
- A uniform decode batch (one new token per request) runs `_decode_attention`, one
  program per (token, KV head, segment).
- Any other batch (prefills, chunks, decodes beside them) runs `_prefill_attention`,
  one program per (tile of BLOCK_Q query tokens of one request, KV head, segment), over
  `cdiv(padded tokens, BLOCK_Q) + min(request rows, padded tokens)` tiles: enough for
  every request's tiles whatever the split of tokens between requests.

Split-KV (flash-decoding): a small batch cannot fill the GPU with one program per token
and KV head, so each program's context (from its window start, if any) is cut into
`num_segments(padded tokens)` equal runs of tiles; each program reduces its run to a
partial (max, sum, unnormalised output) in the workspace and `_reduce_segments`
combines a token's segments, one program per (token, query head). At batch 1 on 8 KV
heads that is 64 segments: a long context is read by 512 programs at once. Large batches
get one segment: the attention kernel normalises and writes the output itself.

Both attention kernels compute `tl.dot` tiles that pack the query heads of a GQA group
as rows: [rows, head] x [head, TILE positions] for the scores, [rows, TILE] x [TILE,
head] for the output, with an online softmax (base 2) over the tiles; rows are one
token's group padded to 16 (tl.dot's minimum) in decode, BLOCK_Q tokens x the group in
prefill. A tile is one block at block sizes 16 and 32 (`kv_tile`); since it reads its
positions through the block table, other block sizes work too. A sliding window starts
the walk at the first tile the window reaches; logits soft-capping applies
cap * tanh(s / cap) before the softmax (Gemma).

Graph safety: every value the kernels read at run time is a device tensor
(query_start_loc, seq_lens, block_tables, slot_mapping), and the launch grids depend only
on tensor shapes (padded tokens, request rows) and on `uniform_decode`, which a graph's
key fixes (a uniform graph only ever replays uniform batches). One captured launch is
therefore right for any batch of its size, and no host value needs refreshing before a
replay: `cudagraph_support = ALWAYS`. The segment count is a function of the padded token
count only, and the partial buffers, sized for every batch that splits (at most
SPLIT_PROGRAMS // kv_heads token-segments), are allocated by `allocate_workspace`
before capture.

A token belongs to the request whose query_start_loc range holds it; tokens at or past
query_start_loc's tail (padding) belong to none and output zeros. For that the runner
keeps the tail at the real token count over every request row a graph's metadata spans
(worker/model_runner.py).

The kernels are in triton_kernels.py. Under TRITON_INTERPRET=1 they run on CPU tensors (numpy), which is how the test
suite checks them on machines without a GPU (tests/attention/test_triton_attn.py);
tests/attention/test_triton_compile.py compiles every variant for sm_90 without one.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import triton

from decodegraph.attention.backends.base import AttentionBackend, AttentionCGSupport
from decodegraph.attention.backends.triton_kernels import (
    DECODE_ROWS,
    MAX_SEGMENTS,
    PREFILL_ROWS,
    PREFILL_ROWS_WIDE,
    SPLIT_PROGRAMS,
    _decode_attention,
    _prefill_attention,
    _reduce_segments,
    _write_kv,
    kv_tile,
)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention whose every input is a device tensor: graph-safe for any batch."""

    name: ClassVar[str] = "TRITON_ATTN"
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    # Upper bound of num_segments (tests lower it to pin the unsplit or a given split).
    max_segments: int = MAX_SEGMENTS

    # Split-KV partials, allocated by allocate_workspace (None: no split).
    _part_acc: torch.Tensor | None = None
    _part_m: torch.Tensor | None = None
    _part_l: torch.Tensor | None = None

    def num_segments(self, num_tokens: int) -> int:
        """Segments each context of a uniform decode batch of `num_tokens` padded rows is
        cut into: a power of two, fixed by the batch's padded size (never by its lengths),
        so that a captured grid stays right for every replay."""
        programs = num_tokens * self.num_kv_heads
        segments = 1
        while segments < self.max_segments and programs * segments * 2 <= SPLIT_PROGRAMS:
            segments *= 2
        return segments

    def _partial_rows(self) -> int:
        """(token, segment) rows the partials need for any batch that splits: past
        SPLIT_PROGRAMS // kv_heads tokens none does, so this bound holds for every
        batch size (at most SPLIT_PROGRAMS // kv_heads rows)."""
        sizes = range(1, SPLIT_PROGRAMS // self.num_kv_heads + 1)
        return max((n * self.num_segments(n) for n in sizes if self.num_segments(n) > 1), default=0)

    def workspace_bytes(self, max_num_reqs: int, dtype: torch.dtype) -> int:
        # float32 partials whatever the model dtype: acc, then m and l, per query head.
        return 4 * self._partial_rows() * self.num_heads * (self.head_size + 2)

    def allocate_workspace(
        self, max_num_reqs: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """The split-KV partials, for every batch size (max_num_reqs bounds none: a
        batch splits only while it is small)."""
        rows = self._partial_rows() * self.num_heads
        self._part_acc = torch.empty(rows * self.head_size, dtype=torch.float32, device=device)
        self._part_m = torch.empty(rows, dtype=torch.float32, device=device)
        self._part_l = torch.empty(rows, dtype=torch.float32, device=device)

    def graph_tensors(self, params_id: int) -> list[torch.Tensor]:
        parts = [t for t in (self._part_acc, self._part_m, self._part_l) if t is not None]
        return [*super().graph_tensors(params_id), *parts]

    def _segments(self, num_tokens: int) -> int:
        """num_segments, or 1 where the partials cannot hold this batch's."""
        segments = self.num_segments(num_tokens)
        capacity = 0 if self._part_m is None else self._part_m.numel() // self.num_heads
        return segments if num_tokens * segments <= capacity else 1

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        layer_idx: int,
        params_id: int,
    ) -> None:
        md = self.params[params_id]
        if md.num_actual_tokens == 0:  # the profiling run: no requests, no caches yet
            output.zero_()
            return
        k_cache, v_cache = self.layer_caches[layer_idx]
        t = query.shape[0]
        num_reqs = md.query_start_loc.numel() - 1
        kvd = self.num_kv_heads * self.head_size
        qd = self.num_heads * self.head_size
        _write_kv[(t,)](
            key,
            value,
            k_cache,
            v_cache,
            md.slot_mapping,
            output,
            md.query_start_loc,
            num_reqs,
            key.stride(0),
            value.stride(0),
            output.stride(0),
            ROW=kvd,
            ROW_PAD=triton.next_power_of_2(kvd),
            OUT_ROW=qd,
            OUT_ROW_PAD=triton.next_power_of_2(qd),
            BLOCK_SIZE=self.block_size,
        )
        group = self.num_heads // self.num_kv_heads
        # The attention kernels' arguments before and after the request count.
        head = (query, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc)
        tail = (query.stride(0), output.stride(0), md.block_tables.stride(0), self.scale)
        common = dict(
            NUM_KV_HEADS=self.num_kv_heads,
            GROUP=group,
            HEAD_SIZE=self.head_size,
            HEAD_PAD=max(16, triton.next_power_of_2(self.head_size)),
            BLOCK_SIZE=self.block_size,
            TILE=kv_tile(self.block_size),
            SLIDING_WINDOW=self.sliding_window or 0,
            SOFT_CAP=float(self.logits_soft_cap or 0.0),
            # fp32 models get fp32 products, not tf32's 10-bit mantissas.
            DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        )
        segments = self._segments(t)
        # Unsplit, the attention kernels write `output` and never touch the partials.
        parts = (self._part_acc, self._part_m, self._part_l) if segments > 1 else (output,) * 3
        split = dict(NUM_HEADS=self.num_heads, NUM_SEGMENTS=segments)
        if md.uniform_decode:
            _decode_attention[(t, self.num_kv_heads, segments)](
                output,
                *parts,
                *head,
                num_reqs,
                *tail,
                GROUP_PAD=max(DECODE_ROWS, triton.next_power_of_2(group)),
                **split,
                **common,
            )
        else:
            wide = k_cache.element_size() > 2 or self.head_size > 128
            block_m = max(
                PREFILL_ROWS_WIDE if wide else PREFILL_ROWS, triton.next_power_of_2(group)
            )
            block_q = block_m // group
            # Rows past the real requests are empty and every real one has a token, so
            # no more than t requests own programs (the kernel searches only those).
            searched = min(num_reqs, t)
            programs = triton.cdiv(t, block_q) + searched
            _prefill_attention[(programs, self.num_kv_heads, segments)](
                output,
                *parts,
                *head,
                searched,
                *tail,
                BLOCK_M=block_m,
                BLOCK_Q=block_q,
                REQS_PAD=triton.next_power_of_2(searched),
                **split,
                **common,
            )
        if segments > 1:
            _reduce_segments[(t, self.num_heads)](
                output,
                *parts,
                md.query_start_loc,
                num_reqs,
                output.stride(0),
                NUM_HEADS=self.num_heads,
                HEAD_SIZE=self.head_size,
                HEAD_PAD=common["HEAD_PAD"],
                NUM_SEGMENTS=segments,
            )
