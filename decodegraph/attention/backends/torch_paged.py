"""Paged attention in plain PyTorch ops: the CPU backend and a CUDA fallback.

Both write this step's K/V into the paged cache, gather each request's context by its
block table into a workspace allocated once (sized for max_model_len), and call
`scaled_dot_product_attention`.

- `CPUAttentionBackend` reads host values (lengths) from its metadata slot. On CPU the
  attention op's Python runs at every replay, so a graph replays correctly as long as
  `update_graph_params` refreshed the slot: its cost follows the batch's real lengths,
  not max_model_len, and mixed batches work inside a graph (support ALWAYS).
- `CUDATorchAttentionBackend`: inside a CUDA graph no Python runs at replay, so the
  captured decode path may only read device tensors: it gathers max_model_len worth of
  blocks and masks by `seq_lens`. Only uniform single-token decode is graph-safe.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from decodegraph.attention.backends.base import AttentionBackend, AttentionMetadata
from decodegraph.graphs.modes import AttentionCGSupport


class CPUAttentionBackend(AttentionBackend):
    """Paged attention whose lengths are host values (graph params)."""

    name: ClassVar[str] = "CPU_TORCH_SDPA"
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._ws_k: torch.Tensor | None = None
        self._ws_v: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    def allocate_workspace(self, max_num_reqs: int, dtype: torch.dtype, device: torch.device) -> None:
        """Gather buffers for `max_num_reqs` contexts of max_model_len tokens each."""
        k_cache = self.kv_caches[0][0]
        row = k_cache[0].numel()  # one block's worth of values
        rows = max_num_reqs * self.max_blocks_per_seq
        self._ws_k = torch.empty(rows, row, dtype=k_cache.dtype, device=k_cache.device)
        self._ws_v = torch.empty_like(self._ws_k)
        self._positions = torch.arange(
            self.max_blocks_per_seq * self.block_size, device=k_cache.device
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        slot: int,
    ) -> torch.Tensor:
        md = self.slots[slot]
        n = md.num_actual_tokens
        if n == 0:  # the profiling run: no requests, nothing to attend or write
            return torch.zeros_like(query)
        k_cache, v_cache = self.kv_caches[layer_idx]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_size
        # Padded rows sit at the tail; writing only the first n rows skips them.
        slots = md.slot_mapping[:n]
        k_cache.view(-1, kvh, d)[slots] = key[:n].view(n, kvh, d)
        v_cache.view(-1, kvh, d)[slots] = value[:n].view(n, kvh, d)

        out = torch.zeros_like(query)
        if md.uniform_decode:
            out[:n] = self._decode(query[:n].view(n, h, d), k_cache, v_cache, md).view(n, h * d)
        else:
            self._mixed(query, k_cache, v_cache, md, out)
        return out

    def _gather(
        self, cache: torch.Tensor, workspace: torch.Tensor, block_ids: torch.Tensor
    ) -> torch.Tensor:
        """Copy the given blocks into the workspace: [num_blocks_gathered * block_size, kvh, d]."""
        flat = cache.view(cache.shape[0], -1)
        ids = block_ids.reshape(-1)
        out = workspace[: ids.numel()]
        torch.index_select(flat, 0, ids, out=out)
        return out.view(-1, self.num_kv_heads, self.head_size)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """One new token per request, all requests in one batched SDPA."""
        b, bs = md.num_reqs, self.block_size
        nb = -(-md.max_seq_len // bs)
        block_ids = md.block_tables[:b, :nb]
        k = self._gather(k_cache, self._ws_k, block_ids).view(b, nb * bs, self.num_kv_heads, -1)
        v = self._gather(v_cache, self._ws_v, block_ids).view(b, nb * bs, self.num_kv_heads, -1)
        if b == 1:
            length = md.max_seq_len
            k, v, mask = k[:, :length], v[:, :length], None
        else:
            mask = (self._positions[: nb * bs] < md.seq_lens[:b, None]).view(b, 1, 1, nb * bs)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [b, h, 1, d]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    def _mixed(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """Any batch: one SDPA per request, causal with the context offset."""
        h, d, bs = self.num_heads, self.head_size, self.block_size
        qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
        for i in range(md.num_reqs):
            start, end, length = qsl[i], qsl[i + 1], lens[i]
            q_len = end - start
            nb = -(-length // bs)
            block_ids = md.block_tables[i, :nb]
            k = self._gather(k_cache, self._ws_k, block_ids)[:length]
            v = self._gather(v_cache, self._ws_v, block_ids)[:length]
            q = query[start:end].view(q_len, h, d).transpose(0, 1)
            mask = None
            if 1 < q_len < length:
                q_pos = self._positions[length - q_len : length]
                mask = self._positions[:length][None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                is_causal=q_len == length and q_len > 1,
                scale=self.scale,
                enable_gqa=True,
            )
            out[start:end] = o.transpose(0, 1).reshape(q_len, h * d)


class CUDATorchAttentionBackend(CPUAttentionBackend):
    """CUDA fallback in torch ops; graph-safe for uniform single-token decode only."""

    name: ClassVar[str] = "CUDA_TORCH_SDPA"
    cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        slot: int,
    ) -> torch.Tensor:
        md = self.slots[slot]
        if not (md.uniform_decode and torch.cuda.is_current_stream_capturing()):
            return super().forward(query, key, value, layer_idx, slot)
        # Captured decode: nothing here may depend on host values except shapes.
        k_cache, v_cache = self.kv_caches[layer_idx]
        t = query.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_size
        # Padded rows (slot -1) write into the reserved null block 0, never read.
        slots = md.slot_mapping[:t].clamp(min=0)
        k_cache.view(-1, kvh, d).index_copy_(0, slots, key.view(t, kvh, d))
        v_cache.view(-1, kvh, d).index_copy_(0, slots, value.view(t, kvh, d))
        nb = self.max_blocks_per_seq
        block_ids = md.block_tables[:t, :nb].clamp(min=0)
        k = self._gather(k_cache, self._ws_k, block_ids).view(t, nb * self.block_size, kvh, d)
        v = self._gather(v_cache, self._ws_v, block_ids).view(t, nb * self.block_size, kvh, d)
        mask = (self._positions < md.seq_lens[:t, None]).view(t, 1, 1, -1)
        out = F.scaled_dot_product_attention(
            query.view(t, h, 1, d),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.view(t, h * d)
