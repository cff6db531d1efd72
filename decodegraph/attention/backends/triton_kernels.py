"""The Triton kernels of TRITON_ATTN and their tile constants (the design, the launch
grids and graph safety are described in triton_attn.py, which launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

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
