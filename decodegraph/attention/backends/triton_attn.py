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

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (numpy), which is how the test
suite checks them on machines without a GPU (tests/attention/test_triton_attn.py);
tests/attention/test_triton_compile.py compiles every variant for sm_90 without one.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import triton
import triton.language as tl

from decodegraph.attention.backends.base import AttentionBackend, AttentionCGSupport

# Query rows (tokens x group heads) per prefill program, at least: 64 for 16-bit caches
# up to head size 128; 32 otherwise (fp32's exact products and head size 256 need the
# registers: tests/attention/test_triton_compile.py reports spills beyond these).
PREFILL_ROWS = 64
PREFILL_ROWS_WIDE = 32
# Query rows per decode program, at least: tl.dot's smallest M.
DECODE_ROWS = 16
# A split launch aims for this many programs (tokens x KV heads x segments): a few per
# SM on the GPUs this targets, so that one request's context fills the device.
SPLIT_PROGRAMS = 512
# The most segments one context is cut into; also bounds the reduction's width.
MAX_SEGMENTS = 64


def kv_tile(block_size: int) -> int:
    """KV positions per tile: one whole block where it is 16 or 32 positions (one block
    table entry per tile, whose addresses cost fewer registers than a gather), 32 within
    a larger block, 16 across smaller blocks (tl.dot's smallest N)."""
    return min(max(block_size, 16), 32)


@triton.jit
def _write_kv(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    out,
    query_start_loc,
    num_reqs,  # request rows of the metadata (query_start_loc has num_reqs + 1)
    key_stride,
    value_stride,
    out_stride,
    ROW: tl.constexpr,  # kv_heads * head_size
    ROW_PAD: tl.constexpr,
    OUT_ROW: tl.constexpr,  # heads * head_size
    OUT_ROW_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        c = tl.arange(0, ROW_PAD)  # head * head_size + dim: row c of the block's tiles
        live = c < ROW
        dst = (slot // BLOCK_SIZE) * ROW * BLOCK_SIZE + c * BLOCK_SIZE + slot % BLOCK_SIZE
        k = tl.load(key + t * key_stride + c, mask=live)
        v = tl.load(value + t * value_stride + c, mask=live)
        tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=live)
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=live)
    if t >= tl.load(query_start_loc + num_reqs):  # padding: no attention program covers it
        c = tl.arange(0, OUT_ROW_PAD)
        zeros = tl.zeros([OUT_ROW_PAD], out.dtype.element_ty)
        tl.store(out + t * out_stride + c, zeros, mask=c < OUT_ROW)


@triton.jit
def _attend_tile(
    q,  # [ROWS, HEAD_PAD] in the cache's dtype
    m_i,  # [ROWS] running maximum of the scores, base 2
    l_i,  # [ROWS] running sum of exp2(score - m_i)
    acc,  # [ROWS, HEAD_PAD] float32, unnormalised output
    k_cache,
    v_cache,
    block_row,  # this request's block table row
    kv_head,
    tile,
    ctx_rows,  # [ROWS] positions each row sees: [0, ctx) (0: a dead row)
    ctx_end,  # the largest of ctx_rows: no position at or past it is read
    scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One tile of TILE positions into the online softmax; returns (m_i, l_i, acc)."""
    j = tl.arange(0, TILE)
    d = tl.arange(0, HEAD_PAD)
    d_live = d < HEAD_SIZE
    pos = tile * TILE + j
    kv_live = pos < ctx_end
    block_elems = NUM_KV_HEADS * HEAD_SIZE * BLOCK_SIZE
    if BLOCK_SIZE % TILE == 0:  # the whole tile lies in one block: one table entry
        block = tl.load(block_row + tile * TILE // BLOCK_SIZE).to(tl.int64)
        col = block * block_elems + (tile * TILE) % BLOCK_SIZE + j
    else:  # the tile spans blocks: an entry per position
        block = tl.load(block_row + pos // BLOCK_SIZE, mask=kv_live, other=0).to(tl.int64)
        col = block * block_elems + pos % BLOCK_SIZE
    col += kv_head * HEAD_SIZE * BLOCK_SIZE
    # Cache layout [block, kv_head, dim, offset]: K arrives as K^T, [dim, position].
    k = tl.load(
        k_cache + col[None, :] + d[:, None] * BLOCK_SIZE,
        mask=d_live[:, None] & kv_live[None, :],
        other=0.0,
    )
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
    if SOFT_CAP > 0:  # cap * tanh(s / cap), tanh(x) = 2 / (1 + exp(-2x)) - 1
        s = SOFT_CAP * (2.0 / (1.0 + tl.exp(-2.0 * s / SOFT_CAP)) - 1.0)
    s = s * 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
    live = pos[None, :] < ctx_rows[:, None]
    if SLIDING_WINDOW > 0:
        live = live & (pos[None, :] >= ctx_rows[:, None] - SLIDING_WINDOW)
    s = tl.where(live, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen no live position yet keeps m = -inf; subtract 0 there, not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_cache + col[:, None] + d[None, :] * BLOCK_SIZE,
        mask=kv_live[:, None] & d_live[None, :],
        other=0.0,
    )
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _store_rows(
    out,
    part_acc,
    part_m,
    part_l,
    m_i,
    l_i,
    acc,
    toks,  # [ROWS] each row's token
    heads,  # [ROWS] each row's query head
    rows_live,  # [ROWS]
    seg,
    out_stride,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """A program's rows: normalised into `out` (one segment), else its segment's
    partial state (m, l, unnormalised acc), which _reduce_segments combines."""
    d = tl.arange(0, HEAD_PAD)
    mask = rows_live[:, None] & (d < HEAD_SIZE)[None, :]
    if NUM_SEGMENTS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out + toks[:, None] * out_stride + heads[:, None] * HEAD_SIZE + d[None, :]
        tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=mask)
    else:
        # Every segment stores, one that saw no position too (m = -inf, l = 0): the
        # reduction reads all of a token's segments and no buffer needs clearing first.
        row = (toks * NUM_SEGMENTS + seg) * NUM_HEADS + heads
        tl.store(part_m + row, m_i, mask=rows_live)
        tl.store(part_l + row, l_i, mask=rows_live)
        tl.store(part_acc + row[:, None] * HEAD_SIZE + d[None, :], acc, mask=mask)


@triton.jit
def _decode_attention(
    out,
    part_acc,  # [tokens * NUM_SEGMENTS, NUM_HEADS, HEAD_SIZE] float32 (split only)
    part_m,  # [tokens * NUM_SEGMENTS, NUM_HEADS] float32 (split only)
    part_l,  # [tokens * NUM_SEGMENTS, NUM_HEADS] float32 (split only)
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    num_reqs,
    query_stride,
    out_stride,
    bt_stride,
    scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    SOFT_CAP: tl.constexpr,  # 0.0: none
    DOT_PRECISION: tl.constexpr,
):
    # A uniform batch: token t is request t's one new token, the last of its context.
    t = tl.program_id(0)
    kh = tl.program_id(1)
    seg = tl.program_id(2)
    real = t < tl.load(query_start_loc + num_reqs)
    ctx = tl.load(seq_lens + t, mask=real, other=0)
    first = 0
    if SLIDING_WINDOW > 0:
        first = tl.maximum(ctx - SLIDING_WINDOW, 0)
    first_tile = first // TILE
    num_tiles = tl.cdiv(ctx, TILE)
    per_segment = tl.cdiv(num_tiles - first_tile, NUM_SEGMENTS)
    lo = first_tile + seg * per_segment
    hi = tl.minimum(lo + per_segment, num_tiles)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    g_live = g < GROUP
    d_live = d < HEAD_SIZE
    heads = kh * GROUP + g
    q = tl.load(
        query + t * query_stride + heads[:, None] * HEAD_SIZE + d[None, :],
        mask=g_live[:, None] & d_live[None, :],
        other=0.0,
    ).to(k_cache.dtype.element_ty)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    ctx_rows = tl.zeros([GROUP_PAD], tl.int32) + ctx
    block_row = block_tables + t * bt_stride
    for tile in range(lo, hi):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache,
            v_cache,
            block_row,
            kh,
            tile,
            ctx_rows,
            ctx,
            scale,
            NUM_KV_HEADS,
            HEAD_SIZE,
            HEAD_PAD,
            BLOCK_SIZE,
            TILE,
            SLIDING_WINDOW,
            SOFT_CAP,
            DOT_PRECISION,
        )
    # A padding token (ctx 0) stores zeros or empty segments, as _write_kv zeroed it.
    toks = tl.zeros([GROUP_PAD], tl.int32) + t
    _store_rows(
        out,
        part_acc,
        part_m,
        part_l,
        m_i,
        l_i,
        acc,
        toks,
        heads,
        g_live,
        seg,
        out_stride,
        NUM_HEADS,
        HEAD_SIZE,
        HEAD_PAD,
        NUM_SEGMENTS,
    )


@triton.jit
def _reduce_segments(
    out,
    part_acc,
    part_m,
    part_l,
    query_start_loc,
    num_reqs,
    out_stride,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    # Padding tokens: no partials of theirs need exist (a prefill grid covers none) and
    # _write_kv zeroed their output. (A scalar & vector mask trips the interpreter.)
    real = t < tl.load(query_start_loc + num_reqs)
    s = tl.arange(0, NUM_SEGMENTS)
    d = tl.arange(0, HEAD_PAD)
    d_live = d < tl.where(real, HEAD_SIZE, 0)
    row = (t * NUM_SEGMENTS + s) * NUM_HEADS + h
    m = tl.load(part_m + row, mask=s < tl.where(real, NUM_SEGMENTS, 0), other=float("-inf"))
    has = m > float("-inf")  # segments that saw positions
    m_max = tl.max(m, axis=0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(has, tl.exp2(m - m_ref), 0.0)
    l_sum = tl.sum(w * tl.load(part_l + row, mask=has, other=0.0), axis=0)
    acc_ptrs = part_acc + row[:, None] * HEAD_SIZE + d[None, :]
    acc = tl.load(acc_ptrs, mask=has[:, None] & d_live[None, :], other=0.0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_sum > 0, l_sum, 1.0)
    o_ptrs = out + t * out_stride + h * HEAD_SIZE + d
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=d_live)


@triton.jit
def _prefill_attention(
    out,
    part_acc,  # as _decode_attention's (split only)
    part_m,
    part_l,
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    num_reqs,
    query_stride,
    out_stride,
    bt_stride,
    scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows: BLOCK_Q tokens x GROUP heads, padded
    BLOCK_Q: tl.constexpr,
    REQS_PAD: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    SOFT_CAP: tl.constexpr,  # 0.0: none
    DOT_PRECISION: tl.constexpr,
):
    p = tl.program_id(0)
    kh = tl.program_id(1)
    seg = tl.program_id(2)
    # Request r owns programs from query_start_loc[r] // BLOCK_Q + r on: at least as
    # many as its cdiv(tokens, BLOCK_Q) tiles, in order. This program's request is the
    # last one starting at or before it.
    r_idx = tl.arange(0, REQS_PAD)
    r_live = r_idx < num_reqs
    starts = tl.load(query_start_loc + r_idx, mask=r_live, other=0) // BLOCK_Q + r_idx
    r = tl.sum((r_live & (starts <= p)).to(tl.int32), axis=0) - 1
    q_start = tl.load(query_start_loc + r)
    q_end = tl.load(query_start_loc + r + 1)
    seq_len = tl.load(seq_lens + r)
    q0 = q_start + (p - (q_start // BLOCK_Q + r)) * BLOCK_Q

    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_PAD)
    d_live = d < HEAD_SIZE
    tok = q0 + i // GROUP
    row_live = (i < BLOCK_Q * GROUP) & (tok < q_end)
    heads = kh * GROUP + i % GROUP
    # Causal: the token at index t sees its context up to and including itself.
    ctx_rows = tl.where(row_live, seq_len - q_end + tok + 1, 0)
    ctx_end = tl.max(ctx_rows, axis=0)
    first = 0
    if SLIDING_WINDOW > 0:  # the first token's window starts earliest
        first = tl.maximum(seq_len - q_end + q0 + 1 - SLIDING_WINDOW, 0)
    q = tl.load(
        query + tok[:, None] * query_stride + heads[:, None] * HEAD_SIZE + d[None, :],
        mask=row_live[:, None] & d_live[None, :],
        other=0.0,
    ).to(k_cache.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    block_row = block_tables + r * bt_stride
    first_tile = first // TILE
    per_segment = tl.cdiv(tl.cdiv(ctx_end, TILE) - first_tile, NUM_SEGMENTS)
    lo = first_tile + seg * per_segment
    hi = tl.minimum(lo + per_segment, tl.cdiv(ctx_end, TILE))
    for tile in range(lo, hi):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache,
            v_cache,
            block_row,
            kh,
            tile,
            ctx_rows,
            ctx_end,
            scale,
            NUM_KV_HEADS,
            HEAD_SIZE,
            HEAD_PAD,
            BLOCK_SIZE,
            TILE,
            SLIDING_WINDOW,
            SOFT_CAP,
            DOT_PRECISION,
        )
    _store_rows(
        out,
        part_acc,
        part_m,
        part_l,
        m_i,
        l_i,
        acc,
        tok,
        heads,
        row_live,
        seg,
        out_stride,
        NUM_HEADS,
        HEAD_SIZE,
        HEAD_PAD,
        NUM_SEGMENTS,
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
