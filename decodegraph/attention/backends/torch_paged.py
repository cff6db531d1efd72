"""Paged attention in plain PyTorch ops: the CPU backend and a CUDA fallback.

Both write this step's K/V into the paged cache, gather each request's context by its
block table into a workspace allocated once (sized for max_model_len), and call
`scaled_dot_product_attention`.

- `CPUAttentionBackend` reads host values (lengths, request count) from its graph
  params. On CPU the attention runs its own code at every replay, so a graph replays
  correctly as long as `update_graph_params` refreshed its params: its cost follows the
  batch's real lengths, not max_model_len, and mixed batches work inside a graph
  (support ALWAYS). With float32 and bfloat16 caches every batch is one native operator
  per layer (`decodegraph_cpu::paged_attention`, see decodegraph/native) that reads the
  params' host tensors; float16 caches, or a machine where the operators cannot be built,
  take the tensor-op path below.
- `CUDATorchAttentionBackend`: inside a CUDA graph no Python runs at replay, so the
  captured decode path may only read device tensors: it gathers max_model_len worth of
  blocks and masks by `seq_lens`. Only uniform single-token decode is graph-safe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F

from decodegraph.attention.backends.base import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    explicit_attention,
    soft_cap_,
)
from decodegraph.forward_context import EAGER_PARAMS_ID
from decodegraph.native import load_cpu_ops

# Scores one masked SDPA call may hold (float32 in torch's math kernel): 256 MiB.
_MASKED_SCORES = 1 << 26


class CPUAttentionBackend(AttentionBackend):
    """Paged attention whose lengths are host values (graph params)."""

    name: ClassVar[str] = "CPU_TORCH"
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    # float32/bfloat16 caches run in the native operator; subclasses on devices opt out.
    use_native_kernel: ClassVar[bool] = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._ws_k: torch.Tensor | None = None
        self._ws_v: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        # Per layer: the caches as [blocks, block_size, kvh, d] (token_view), for writes
        # by (block, offset) and gathers of whole blocks.
        self._token_views: list[tuple[torch.Tensor, torch.Tensor]] = []
        ops = load_cpu_ops() if self.use_native_kernel else None
        # Full attention without soft-capping takes the operator with fewer arguments.
        self._plain = not self.sliding_window and not self.logits_soft_cap
        self._native_op = None
        if ops is not None:
            plain, extended = ops.paged_attention, ops.paged_attention_windowed_capped
            self._native_op = (plain if self._plain else extended).default
        self._native_out_op = ops.paged_attention_out.default if ops is not None else None
        self._scores: torch.Tensor | None = None

    def bind_kv_caches(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        layer_indices: Sequence[int] | None = None,
    ) -> None:
        super().bind_kv_caches(kv_caches, layer_indices)
        self._token_views = [
            None if pair is None else (self.token_view(pair[0]), self.token_view(pair[1]))
            for pair in self.layer_caches
        ]

    def _gathers(self, dtype: torch.dtype) -> bool:
        """Whether steps gather contexts into a workspace: every step but the native
        operator's (float32 and bfloat16 caches where it was built)."""
        return self._native_op is None or dtype not in (torch.float32, torch.bfloat16)

    def _workspace_shapes(
        self, max_num_reqs: int, dtype: torch.dtype
    ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each workspace tensor."""
        # The native operator's scores, one row per intra-op thread (a large step splits
        # its requests over them): one context's scores per query head of a KV head's
        # group, then (head_size + 1) * block_size accumulators.
        shapes = []
        if self._native_op is not None:
            group = self.num_heads // self.num_kv_heads
            positions = group * self.max_blocks_per_seq + self.head_size + 1
            shapes.append(((torch.get_num_threads(), positions * self.block_size), torch.float32))
        if self._gathers(dtype):
            # K and V of max_num_reqs contexts of max_model_len, as whole blocks; then
            # the position of each gathered token.
            block = (self.block_size, self.num_kv_heads, self.head_size)
            rows = (max_num_reqs * self.max_blocks_per_seq, *block)
            shapes += [(rows, dtype), (rows, dtype)]
            shapes.append(((self.max_blocks_per_seq * self.block_size,), torch.int64))
        return shapes

    def workspace_bytes(self, max_num_reqs: int, dtype: torch.dtype) -> int:
        return sum(
            math.prod(shape) * t.itemsize
            for shape, t in self._workspace_shapes(max_num_reqs, dtype)
        )

    def allocate_workspace(
        self, max_num_reqs: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """The native operator's scores where it runs, and where steps gather contexts,
        gather buffers for max_num_reqs of max_model_len."""
        shapes = self._workspace_shapes(max_num_reqs, dtype)
        if self._native_op is not None:
            self._scores = torch.empty(shapes.pop(0)[0])
        if shapes:
            (rows, _), _, ((positions,), _) = shapes
            self._ws_k = torch.empty(rows, dtype=dtype, device=device)
            self._ws_v = torch.empty_like(self._ws_k)
            self._positions = torch.arange(positions, device=device)

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
        n = md.num_actual_tokens
        if n == 0:  # the profiling run: no requests, nothing to attend or write
            output.zero_()
            return
        direct = self.native_op_args(layer_idx, params_id)
        if direct is not None:
            _, args = direct
            if self._plain:
                args += (0, 0.0)
            self._native_out_op(query, key, value, *args, output)
            return
        # Padded rows sit at the tail; writing only the first n rows skips them.
        padded = n < query.shape[0]
        slots = md.slot_mapping[:n] if padded else md.slot_mapping
        self._write(layer_idx, slots, key[:n] if padded else key, value[:n] if padded else value)
        if padded:
            output[n:].zero_()
        if md.uniform_decode:
            output[:n] = self._decode(query[:n] if padded else query, layer_idx, md)
        else:
            self._mixed(query, layer_idx, md, output)

    def supports_multi_step_graphs(self) -> bool:
        # The native operator reads them at run time; the tensor-op path (steps that
        # gather) bakes max_seq_len, a host value, into a decode step.
        return not any(self._gathers(k_cache.dtype) for k_cache, _ in self.kv_caches)

    def supports_dynamic_rows(self) -> bool:
        # The same condition: the native operator reads the request count at run time.
        return self.supports_multi_step_graphs()

    def graph_tensors(self, params_id: int) -> list[torch.Tensor]:
        tensors = super().graph_tensors(params_id)
        return tensors if self._scores is None else [*tensors, self._scores]

    def native_op_args(self, layer_idx: int, params_id: int) -> tuple | None:
        md = self.params[params_id]
        if self._native_op is None or md.num_actual_tokens == 0:
            return None
        k_cache, v_cache = self.layer_caches[layer_idx]
        if k_cache.dtype not in (torch.float32, torch.bfloat16):
            return None  # float16: the tensor-op path
        args = (
            k_cache,
            v_cache,
            md.slot_mapping,
            md.block_tables,
            md.query_start_loc_host,
            md.seq_lens_host,
            md.num_reqs_host,
            self.scale,
            self._scores,
        )
        if not self._plain:
            args += (self.sliding_window or 0, self.logits_soft_cap or 0.0)
        return self._native_op, args

    def _write(
        self, layer_idx: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store the K/V rows of tokens at cache slots `slots` (block * block_size + offset)."""
        n, kvh, d = slots.numel(), self.num_kv_heads, self.head_size
        blocks, offsets = slots // self.block_size, slots % self.block_size
        k_tokens, v_tokens = self._token_views[layer_idx]
        k_tokens.index_put_((blocks, offsets), key.reshape(n, kvh, d))
        v_tokens.index_put_((blocks, offsets), value.reshape(n, kvh, d))

    def _gather(
        self, cache_tokens: torch.Tensor, workspace: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Copy blocks `ids` into the workspace: [len(ids), block_size, kvh, d]."""
        return torch.index_select(cache_tokens, 0, ids, out=workspace[: ids.numel()])

    def _decode(self, q: torch.Tensor, layer_idx: int, md: AttentionMetadata) -> torch.Tensor:
        """One new token per request, all requests in one batched attention."""
        b, bs, kvh, d = md.num_reqs, self.block_size, self.num_kv_heads, self.head_size
        nb = -(-md.max_seq_len // bs)
        k_blocks, v_blocks = self._token_views[layer_idx]
        ids = md.block_tables[0, :nb] if b == 1 else md.block_tables[:b, :nb].reshape(-1)
        # [b, kvh, S, d]: the layout both matmuls want.
        k = self._gather(k_blocks, self._ws_k, ids).view(b, nb * bs, kvh, d).transpose(1, 2)
        v = self._gather(v_blocks, self._ws_v, ids).view(b, nb * bs, kvh, d).transpose(1, 2)
        if b == 1:
            k, v = k[:, :, : md.max_seq_len], v[:, :, : md.max_seq_len]
        # Grouped-query attention without repeating K/V: [b, kvh, group, d].
        scores = torch.matmul(q.view(b, kvh, -1, d), k.transpose(2, 3)).mul_(self.scale)
        scores = soft_cap_(scores, self.logits_soft_cap)
        if b > 1 or self.sliding_window:
            lengths = md.seq_lens[:b]  # on the device already (a host copy would race)
            positions = self._positions[: k.shape[2]]
            hidden = positions >= lengths[:, None]
            if self.sliding_window:  # before the window of the one new token
                hidden |= positions < lengths[:, None] - self.sliding_window
            scores.masked_fill_(hidden.view(b, 1, 1, -1), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return out.view(b, self.num_heads * d)

    def _mixed(
        self, query: torch.Tensor, layer_idx: int, md: AttentionMetadata, out: torch.Tensor
    ) -> None:
        """Any batch: one attention per request, causal with the context offset."""
        h, kvh, d, bs = self.num_heads, self.num_kv_heads, self.head_size, self.block_size
        k_blocks, v_blocks = self._token_views[layer_idx]
        qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
        for i in range(md.num_reqs):
            start, end, length = qsl[i], qsl[i + 1], lens[i]
            q_len = end - start
            ids = md.block_tables[i, : -(-length // bs)]
            k = self._gather(k_blocks, self._ws_k, ids).view(-1, kvh, d)[:length]
            v = self._gather(v_blocks, self._ws_v, ids).view(-1, kvh, d)[:length]
            q = query[start:end].view(q_len, h, d).transpose(0, 1)
            if self.sliding_window or self.logits_soft_cap:
                o = explicit_attention(
                    q,
                    k.transpose(0, 1),
                    v.transpose(0, 1),
                    self.scale,
                    self._positions,
                    self.logits_soft_cap,
                    self.sliding_window,
                )
                out[start:end] = o.transpose(0, 1).reshape(q_len, h * d)
                continue
            o = self._causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), length)
            out[start:end] = o.transpose(0, 1).reshape(q_len, h * d)

    def _causal_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int
    ) -> torch.Tensor:
        """q [h, q_len, d], the last q_len of `length` positions; k, v [kvh, length, d].

        Four-dimensional inputs, so that SDPA may take its fused kernels (flash attention
        on CUDA) rather than the math one, which holds every score in float32 (32 GiB for
        one layer of a 32k-token Llama-3.2-1B prompt). A whole prompt is causal from the
        top left (no mask); queries after a cached context need a mask, which no fused
        kernel takes beside GQA, so they go in chunks of query rows whose scores stay
        within _MASKED_SCORES values."""
        h, q_len, _ = q.shape
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if q_len == length or q_len == 1:
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=q_len > 1, scale=self.scale, enable_gqa=True
            )
            return o[0]
        rows = max(1, _MASKED_SCORES // (h * length))
        out = q.new_empty(q.shape)
        for first in range(0, q_len, rows):
            last = min(first + rows, q_len)
            # Query i sees positions up to its own, length - q_len + i.
            seen = length - q_len + last
            q_pos = self._positions[length - q_len + first : seen]
            mask = self._positions[:seen][None, :] <= q_pos[:, None]
            out[:, :, first:last] = F.scaled_dot_product_attention(
                q[:, :, first:last],
                k[:, :, :seen],
                v[:, :, :seen],
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
        return out[0]


class CUDATorchAttentionBackend(CPUAttentionBackend):
    """CUDA fallback in torch ops; graph-safe for uniform single-token decode only."""

    name: ClassVar[str] = "CUDA_TORCH"
    use_native_kernel: ClassVar[bool] = False
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

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
        # A full graph's params (its warm-ups and its capture alike; piecewise steps and
        # eager ones run with the eager params): the one branch that is graph-safe.
        if not (md.uniform_decode and params_id != EAGER_PARAMS_ID):
            super().forward(query, key, value, output, layer_idx, params_id)
            return
        # Captured decode: nothing here may depend on host values except shapes.
        t, kvh, d, bs = query.shape[0], self.num_kv_heads, self.head_size, self.block_size
        k_blocks, v_blocks = self._token_views[layer_idx]
        # Padded rows (slot -1) write into the reserved null block 0, never read.
        self._write(layer_idx, md.slot_mapping[:t].clamp(min=0), key, value)
        nb = self.max_blocks_per_seq
        ids = md.block_tables[:t, :nb].reshape(-1)
        k = self._gather(k_blocks, self._ws_k, ids).view(t, nb * bs, kvh, d).transpose(1, 2)
        v = self._gather(v_blocks, self._ws_v, ids).view(t, nb * bs, kvh, d).transpose(1, 2)
        scores = torch.matmul(query.view(t, kvh, -1, d), k.transpose(2, 3)).mul_(self.scale)
        scores = soft_cap_(scores, self.logits_soft_cap)
        lengths = md.seq_lens[:t, None]
        hidden = self._positions >= lengths
        if self.sliding_window:
            hidden |= self._positions < lengths - self.sliding_window
        # Padded rows have length 0: let them see position 0 so softmax stays finite.
        hidden[:, 0] &= lengths[:, 0] > 0
        scores.masked_fill_(hidden.view(t, 1, 1, -1), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        output.copy_(out.view(t, self.num_heads * d))
