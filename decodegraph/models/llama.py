"""The Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

vLLM's model interface: `forward(input_ids [T], positions [T]) -> hidden [T, H]` over a
flattened batch with no batch dimension, `compute_logits`, and `load_weights` taking
Hugging Face names. q/k/v and gate/up are stacked into one projection each at load time,
and the rotary cos/sin rows are gathered once per forward and shared by every layer,
to keep the op count per layer low (at batch 1 every op is framework overhead).
Under tensor parallelism each rank builds the same modules with its share of the heads
and of the MLP (layers/linear.py), and attends over its own heads only.
Nothing here synchronises with the host or branches on tensor values (docs/design.md §4).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from decodegraph.attention.layer import Attention
from decodegraph.distributed.parallel_state import get_tensor_model_parallel_world_size
from decodegraph.layers.activation import get_act_and_mul_fn
from decodegraph.layers.layernorm import RMSNorm
from decodegraph.layers.linear import (
    FEW_ROWS_MAX,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    attention_heads_per_rank,
    divide,
    few_rows_linear,
    one_row_linear,
)
from decodegraph.layers.rotary_embedding import apply_rotary_emb, get_rope, get_rope_parameters
from decodegraph.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from decodegraph.models.weights import load_stacked_weights


@dataclass(frozen=True)
class AttentionOptions:
    """What differs between the family members' attention blocks."""

    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 via attention_bias)
    o_bias: bool  # bias on the output projection
    qk_norm: bool  # RMSNorm over each head of q and k before rope (Qwen3, Gemma 3)
    scale: float | None = None  # attention score scale; None: head_dim**-0.5
    logits_soft_cap: float | None = None  # scores capped as cap * tanh(s / cap) (Gemma 2)
    norm: type[RMSNorm] = RMSNorm  # the q/k norm's class (Gemma's scales by 1 + weight)


def get_head_dim(config: PretrainedConfig) -> int:
    """`head_dim` from the config, or hidden_size / num_attention_heads when absent."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def get_num_heads(config: PretrainedConfig) -> tuple[int, int]:
    """(num_attention_heads, num_key_value_heads) of the whole model; KV heads default
    to the attention heads (multi-head attention)."""
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def get_num_heads_per_rank(config: PretrainedConfig, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) one of `tp_size` ranks holds (KV heads replicated when
    there are more ranks than KV heads); ValueError naming `tensor_parallel_size` when
    the heads do not split."""
    return attention_heads_per_rank(*get_num_heads(config), tp_size)


def layer_sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """Layer `layer_idx`'s sliding window where transformers applies one: the layers
    `layer_types` marks "sliding_attention" (Qwen2's `use_sliding_window` with
    `max_window_layers`, Qwen3), or every layer of a model with a `sliding_window` and
    no `layer_types` (Mistral); None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up stacked into one projection."""

    def __init__(self, config: PretrainedConfig, hidden_act: str | None = None) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        divide(size, get_tensor_model_parallel_world_size(), "intermediate_size")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias)
        self.act_fn = get_act_and_mul_fn(hidden_act or config.hidden_act)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention: stacked qkv projection, (q/k norm,) rope, paged `Attention`, o_proj."""

    def __init__(
        self,
        config: PretrainedConfig,
        options: AttentionOptions,
        layer_idx: int,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        total_heads, total_kv_heads = get_num_heads(config)
        # This rank's heads (all of them at tensor parallel size 1).
        self.num_heads, self.num_kv_heads = attention_heads_per_rank(
            total_heads, total_kv_heads, get_tensor_model_parallel_world_size()
        )
        self.head_dim = get_head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, options.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, options.o_bias
        )
        self.qk_norm = options.qk_norm
        if self.qk_norm:
            self.q_norm = options.norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = options.norm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5 if options.scale is None else options.scale,
            self.num_kv_heads,
            layer_idx,
            sliding_window=sliding_window,
            logits_soft_cap=options.logits_soft_cap,
        )

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        t = qkv.shape[0]
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:]
        if self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_size].view(t, self.num_kv_heads, self.head_dim))
            q = apply_rotary_emb(q, cos, sin).view(t, self.q_size)
            k = apply_rotary_emb(k, cos, sin).view(t, self.kv_size)
        else:
            # q and k are adjacent in the stacked output: rotate both heads in one pass.
            qk = qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = apply_rotary_emb(qk, cos, sin)
            q = qk[:, : self.num_heads].reshape(t, self.q_size)  # views, no copy
            k = qk[:, self.num_heads :].reshape(t, self.kv_size)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer; the residual stream is carried through fused-add norms."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, layer_idx: int) -> None:
        super().__init__()
        window = layer_sliding_window(config, layer_idx)
        self.self_attn = LlamaAttention(config, options, layer_idx, window)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, sin)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; returns normed hidden states."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, options, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = get_rope(
            get_head_dim(config), config.max_position_embeddings, get_rope_parameters(config)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.get_cos_sin(positions)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos, sin)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama decoder with an LM head (tied to the embedding when `tie_word_embeddings`)."""

    model_class: type[nn.Module] = LlamaModel  # built as model_class(config, options)
    tie_word_embeddings_default = False  # when the config does not say

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        self.config = hf_config
        self.model = self.model_class(hf_config, self.attention_options(hf_config))
        self.tie_word_embeddings = bool(
            getattr(hf_config, "tie_word_embeddings", self.tie_word_embeddings_default)
        )
        # The LM head's batch-1 and few-rows projections (one_row_linear,
        # few_rows_linear), set once the weights are loaded.
        self.logits_one_row = self.logits_few_rows = None
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        """The attention variant of this architecture for `config`."""
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] for flattened token ids [T] at `positions` [T]."""
        return self.model(input_ids, positions)

    def process_weights_after_loading(self) -> None:
        # The LM head is the largest matrix a decode step reads (the embedding's, when tied).
        self.logits_one_row = one_row_linear(self.lm_head.weight)
        self.logits_few_rows = few_rows_linear(self.lm_head.weight)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for hidden states [N, hidden]."""
        one_row, few_rows = self.logits_one_row, self.logits_few_rows
        rows = hidden_states.shape[0] if hidden_states.dim() == 2 else 0
        if one_row is not None and rows == 1:
            logits = one_row(hidden_states, self.lm_head.weight, None)
        elif few_rows is not None and 1 < rows <= FEW_ROWS_MAX:
            logits = few_rows(hidden_states, self.lm_head.weight, None)
        else:
            logits = torch.nn.functional.linear(hidden_states, self.lm_head.weight)
        if self.lm_head.tp_size > 1:  # this rank's vocabulary slice: gather the others'
            logits = self.lm_head.gather_logits(logits)
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the parameters; returns the names of the
        parameters fully loaded (a stacked one only once all its shards arrived)."""
        return load_stacked_weights(self, weights, self.tie_word_embeddings)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama architecture, every layer in its `sliding_window`."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with bias on the q/k/v projections (not on o_proj)."""

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False, qk_norm=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with RMSNorm over each head of q and k, and an explicit head_dim."""

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
