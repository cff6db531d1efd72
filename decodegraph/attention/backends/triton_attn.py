"""Paged attention in two Triton kernels: the CUDA backend (TRITON_ATTN).

`_write_kv` stores this step's K/V rows at their cache slots (slot -1, a padded row,
writes nothing); `_paged_attention` computes every query token of the batch against its
request's context through the block table, one program per (token, KV head) for all
query heads of the group, with an online softmax over the cache blocks. Everything the
kernels read lives in device tensors (query_start_loc, seq_lens, block_tables,
slot_mapping), and the launch grid depends only on the padded token count, so one
captured launch is right for any batch of that size: decode, prefill or mixed. Hence
`cudagraph_support = ALWAYS` and no host values to refresh before a replay.

A query token finds its request as the number of `query_start_loc[1:]` entries at or
below its index; tokens past the real ones (padding) find none and output zeros. For
that, the runner keeps query_start_loc's tail at the real token count over the whole
span a graph's metadata covers (worker/model_runner.py).

Under TRITON_INTERPRET=1 both kernels run on CPU tensors (numpy), which is how the test
suite checks them on machines without a GPU (tests/attention/test_triton_attn.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import triton
import triton.language as tl

from decodegraph.attention.backends.base import AttentionBackend, AttentionCGSupport


@triton.jit
def _write_kv(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    key_stride,
    value_stride,
    ROW: tl.constexpr,  # kv_heads * head_size
    ROW_PAD: tl.constexpr,
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


@triton.jit
def _paged_attention(
    out,
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    num_reqs,  # the padded request count the metadata views span
    query_stride,
    out_stride,
    bt_stride,
    scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    REQS_PAD: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    SOFT_CAP: tl.constexpr,  # 0.0: none
):
    t = tl.program_id(0)
    kh = tl.program_id(1)
    # This token's request: how many requests end at or before it.
    r_idx = tl.arange(0, REQS_PAD)
    ends = tl.load(query_start_loc + 1 + r_idx, mask=r_idx < num_reqs, other=t + 1)
    r = tl.sum((ends <= t).to(tl.int32), axis=0)
    real = r < num_reqs
    r_safe = tl.where(real, r, 0)
    q_end = tl.load(query_start_loc + 1 + r_safe)
    seq_len = tl.load(seq_lens + r_safe)
    # Causal: the token at index t sees its context up to and including itself.
    ctx = tl.where(real, seq_len - q_end + t + 1, 0)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    g_live = g < GROUP
    d_live = d < HEAD_SIZE
    heads = kh * GROUP + g
    q_ptrs = query + t * query_stride + heads[:, None] * HEAD_SIZE + d[None, :]
    q = tl.load(q_ptrs, mask=g_live[:, None] & d_live[None, :], other=0.0).to(tl.float32)
    q = q * scale

    j = tl.arange(0, BLOCK_SIZE)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    tile = (kh * HEAD_SIZE + d[:, None]) * BLOCK_SIZE + j[None, :]  # [HEAD_PAD, BLOCK_SIZE]
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    # A sliding window starts at ctx - W: blocks before it are never read.
    first = 0
    if SLIDING_WINDOW > 0:
        first = tl.maximum(ctx - SLIDING_WINDOW, 0)
    for b in range(first // BLOCK_SIZE, num_blocks):
        block = tl.load(block_tables + r_safe * bt_stride + b).to(tl.int64)
        pos = b * BLOCK_SIZE + j
        live = (pos < ctx) & (pos >= first)
        base = block * NUM_KV_HEADS * HEAD_SIZE * BLOCK_SIZE
        mask = d_live[:, None] & live[None, :]
        k = tl.load(k_cache + base + tile, mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, :, None] * k[None, :, :], axis=1)  # [GROUP_PAD, BLOCK_SIZE]
        if SOFT_CAP > 0:  # cap * tanh(s / cap), tanh(x) = 2 / (1 + exp(-2x)) - 1
            s = SOFT_CAP * (2.0 / (1.0 + tl.exp(-2.0 * s / SOFT_CAP)) - 1.0)
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache + base + tile, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, None, :] * v[None, :, :], axis=2)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out + t * out_stride + heads[:, None] * HEAD_SIZE + d[None, :]
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=g_live[:, None] & d_live[None, :])


class TritonAttentionBackend(AttentionBackend):
    """Paged attention whose every input is a device tensor: graph-safe for any batch."""

    name: ClassVar[str] = "TRITON_ATTN"
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

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
        out = output
        kvd = self.num_kv_heads * self.head_size
        _write_kv[(t,)](
            key,
            value,
            k_cache,
            v_cache,
            md.slot_mapping,
            key.stride(0),
            value.stride(0),
            ROW=kvd,
            ROW_PAD=triton.next_power_of_2(kvd),
            BLOCK_SIZE=self.block_size,
        )
        group = self.num_heads // self.num_kv_heads
        num_reqs = md.query_start_loc.numel() - 1
        _paged_attention[(t, self.num_kv_heads)](
            out,
            query,
            k_cache,
            v_cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            num_reqs,
            query.stride(0),
            out.stride(0),
            md.block_tables.stride(0),
            self.scale,
            NUM_KV_HEADS=self.num_kv_heads,
            GROUP=group,
            GROUP_PAD=triton.next_power_of_2(group),
            HEAD_SIZE=self.head_size,
            HEAD_PAD=triton.next_power_of_2(self.head_size),
            BLOCK_SIZE=self.block_size,
            REQS_PAD=triton.next_power_of_2(max(num_reqs, 1)),
            SLIDING_WINDOW=self.sliding_window or 0,
            SOFT_CAP=float(self.logits_soft_cap or 0.0),
        )
