"""Attention backend contract: graph support level, metadata, graph params, KV caches.

A backend declares how much graph it supports (`cudagraph_support`); it never picks
the graph mode. Its per-step metadata is kept by *params id*: id 0
(`EAGER_PARAMS_ID`) holds the eager step's, rewritten every step; every captured graph
gets params of its own, whose tensor views were fixed at capture and whose host values
are baked into the graph. `update_graph_params(params_id, metadata)` refreshes those
host values before each replay (docs/design.md §1, "graph params").
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from decodegraph.forward_context import EAGER_PARAMS_ID


def soft_cap_(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Logit soft-capping in place, cap * tanh(scores / cap); `scores` as they are
    without a cap."""
    return scores.div_(cap).tanh_().mul_(cap) if cap else scores


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    positions: torch.Tensor,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One sequence's causal attention in explicit ops, for what
    scaled_dot_product_attention has no argument for (soft-capping, sliding windows):
    q [h, q_len, d] at the last q_len of the `length` positions of k/v [kvh, length, d]
    (grouped-query heads without repeating K/V); `positions` is arange(>= length).
    Returns [h, q_len, d]."""
    h, q_len, d = q.shape
    kvh, length = k.shape[0], k.shape[1]
    scores = torch.matmul(q.reshape(kvh, -1, d), k.transpose(1, 2)).mul_(scale)
    scores = soft_cap_(scores, soft_cap).view(kvh, h // kvh, q_len, length)
    q_pos = positions[length - q_len : length, None]
    k_pos = positions[None, :length]
    hidden = k_pos > q_pos
    if sliding_window:
        hidden |= k_pos <= q_pos - sliding_window
    scores.masked_fill_(hidden, float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(kvh, -1, length)
    return torch.matmul(weights, v).view(h, q_len, d)


class AttentionCGSupport(enum.IntEnum):
    """How much of a full graph an attention backend can live inside (more is better)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass
class AttentionMetadata:
    """One step's attention inputs. Tensors are views of the persistent buffers."""

    num_reqs: int  # real requests (padded rows excluded)
    num_actual_tokens: int  # real tokens (padded rows excluded)
    max_query_len: int
    max_seq_len: int  # longest context in the batch, new tokens included
    uniform_decode: bool  # every request adds exactly one token
    # Host copies the attention op reads directly (these are the "graph params").
    query_start_loc_cpu: list[int]  # [num_reqs + 1]
    seq_lens_cpu: list[int]  # [num_reqs]
    # Device tensors (views of persistent buffers; fixed addresses once captured).
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [padded reqs] int32, 0 for padded rows
    block_tables: torch.Tensor  # [padded reqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [padded tokens] int64, -1 for padded rows
    # Host copy of seq_lens (int32, on CPU) that CPU kernels read. A graph's params own
    # a private one, so its values are baked until update_graph_params refreshes them.
    seq_lens_host: torch.Tensor | None = None
    # num_reqs as a one-element int32 CPU tensor, for operators that read it at run time.
    num_reqs_host: torch.Tensor | None = None
    # Host copy of query_start_loc (int32, on CPU), a graph's own like seq_lens_host.
    query_start_loc_host: torch.Tensor | None = None
    # numpy views of the three host tensors, made on first use (update_graph_params).
    _host_arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.seq_lens_host is None:
            self.seq_lens_host = self.seq_lens.to("cpu", torch.int32)
        if self.num_reqs_host is None:
            self.num_reqs_host = torch.tensor([self.num_reqs], dtype=torch.int32)
        if self.query_start_loc_host is None:
            self.query_start_loc_host = self.query_start_loc.to("cpu", torch.int32)

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seq_lens_host, query_start_loc_host, num_reqs_host) as numpy views: a copy
        between them costs far less than a tensor slice and copy_."""
        if self._host_arrays is None:
            self._host_arrays = (
                self.seq_lens_host.numpy(),
                self.query_start_loc_host.numpy(),
                self.num_reqs_host.numpy(),
            )
        return self._host_arrays

    # Host fields, the ones `update_graph_params` copies into a graph's params.
    HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_reqs",
        "num_actual_tokens",
        "max_query_len",
        "max_seq_len",
        "uniform_decode",
        "query_start_loc_cpu",
        "seq_lens_cpu",
    )


class AttentionBackend:
    """Owns the per-layer KV caches and the attention metadata the attention op reads."""

    name: ClassVar[str] = "base"
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        block_size: int,
        max_model_len: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.block_size = block_size
        self.max_model_len = max_model_len
        # A token attends to the last `sliding_window` positions up to its own (None: all).
        self.sliding_window = sliding_window
        # Scores become cap * tanh(score / cap) before the softmax (None: not capped).
        self.logits_soft_cap = logits_soft_cap
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # One K and one V tensor per layer, shaped by get_kv_cache_shape (separate
        # tensors: writes through views of one big tensor copy it when compiled).
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Global layer index -> its (K, V) caches, None for other groups' layers.
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        # params id -> metadata: the eager step's at EAGER_PARAMS_ID, then one per graph.
        self.params: list[AttentionMetadata | None] = [None]

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, int, int, int]:
        """One layer's K cache (and its V cache): [blocks, kv_heads, head_size, block_size].

        Within a block a head's values of one dimension lie side by side for all its
        positions, so an attention kernel multiplies block_size positions per instruction
        (QK and PV alike); docs/performance.md compares it with [blocks, block_size, ...].
        """
        return (num_blocks, num_kv_heads, head_size, block_size)

    @staticmethod
    def token_view(cache: torch.Tensor) -> torch.Tensor:
        """A cache seen as [blocks, block_size, kv_heads, head_size] (a strided view)."""
        return cache.permute(0, 3, 1, 2)

    def bind_kv_caches(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        layer_indices: Sequence[int] | None = None,
    ) -> None:
        """This backend's layers' caches: `kv_caches[i]` is layer `layer_indices[i]`'s
        (by default layer i's). Layers of other attention groups have none here."""
        layers = range(len(kv_caches)) if layer_indices is None else layer_indices
        self.kv_caches = kv_caches
        self.layer_caches = [None] * (max(layers, default=-1) + 1)
        for layer, pair in zip(layers, kv_caches, strict=True):
            self.layer_caches[layer] = pair

    def set_eager_metadata(self, metadata: AttentionMetadata) -> None:
        self.params[EAGER_PARAMS_ID] = metadata

    def new_graph_params(self, metadata: AttentionMetadata) -> int:
        """Params for a graph about to be captured, holding its capture-time metadata;
        returns their id, which the capture bakes into the graph."""
        # A copy with host tensors of its own: their values are baked until the next
        # update, whatever later steps write into the metadata they were copied from.
        metadata = dataclasses.replace(
            metadata,
            seq_lens_host=metadata.seq_lens_host.clone(),
            num_reqs_host=metadata.num_reqs_host.clone(),
            query_start_loc_host=metadata.query_start_loc_host.clone(),
            _host_arrays=None,
        )
        self.params.append(metadata)
        return len(self.params) - 1

    def update_graph_params(self, params_id: int, metadata: AttentionMetadata) -> None:
        """Refresh the host values a graph baked in with this step's values.

        The tensor views in the graph's params keep the addresses the graph was
        captured with; only host values change.
        """
        target = self.params[params_id]
        assert target is not None and params_id != EAGER_PARAMS_ID
        for name in AttentionMetadata.HOST_FIELDS:
            setattr(target, name, getattr(metadata, name))
        n = metadata.num_reqs
        (seq_lens, qsl, num_reqs), src = target.host_arrays(), metadata.host_arrays()
        seq_lens[:n] = src[0][:n]
        qsl[: n + 1] = src[1][: n + 1]
        num_reqs[0] = src[2][0]

    def graph_tensors(self, params_id: int) -> list[torch.Tensor]:
        """Every tensor a graph with these params reads or writes besides the model
        inputs (KV caches, the params' metadata tensors, workspaces). The graph takes
        them as inputs, never as constants: a compiler may fold or copy constants
        (Inductor's freezing does), and these change every step."""
        md = self.params[params_id]
        caches = [t for pair in self.kv_caches for t in pair]
        host = [md.seq_lens_host, md.num_reqs_host, md.query_start_loc_host]
        return caches + [md.slot_mapping, md.block_tables, *host]

    def supports_multi_step_graphs(self) -> bool:
        """Whether a full decode graph may run several steps over these params, each
        later step with the slots and lengths the graph computes: true where every
        attention call of a uniform decode step reads its slots and lengths from the
        params' `slot_mapping` and `seq_lens_host` tensors at run time, and nothing
        else that changes from step to step (no host value baked in at capture)."""
        return False

    def supports_dynamic_rows(self) -> bool:
        """Whether a full decode graph traced with symbolic rows (the dynamic decode
        graph) runs any number of requests over these params: true where every
        attention call of a uniform decode step takes the rows it is given and reads the
        live requests' count, slots and lengths from the params' tensors at run time,
        with no host value of the capture baked in."""
        return False

    def native_op_args(self, layer_idx: int, params_id: int) -> tuple | None:
        """(operator, its arguments after q, k, v) when this step's attention is one
        native operator that the layer may call directly instead of unified_attention
        (a cheaper dispatch, and no Python inside a compiled graph); None otherwise."""
        return None

    def workspace_bytes(self, max_num_reqs: int, dtype: torch.dtype) -> int:
        """Device bytes `allocate_workspace` takes for these arguments: the KV cache
        budget reserves exactly this (none by default)."""
        return 0

    def allocate_workspace(
        self, max_num_reqs: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Allocate, once and before capture, whatever the op needs at run time
        (`workspace_bytes` of it)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        layer_idx: int,
        params_id: int,
    ) -> None:
        """Write this step's K/V into layer `layer_idx`'s cache and attend, writing
        `output` ([num_tokens, num_heads * head_size], padded rows zero) in place."""
        raise NotImplementedError
