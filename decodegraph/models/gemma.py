"""Gemma 2 and Gemma 3 (text): sliding-window and full-attention layers in one model.

What differs from the Llama family: RMSNorm scales by (1 + weight); four norms per layer
(before and after attention, before and after the MLP); a gelu-tanh gated MLP;
embeddings scaled by sqrt(hidden_size); attention scaled by `query_pre_attn_scalar`
rather than the head size. Gemma 2 caps attention scores and the final logits with
tanh (soft-capping); Gemma 3 norms each head of q and k and rotates its sliding layers
with a rope base of their own. `layer_types` says which layers attend through a
sliding window; the model runner gives each kind its own attention group and KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from decodegraph.attention.layer import Attention
from decodegraph.layers.activation import get_act_and_mul_fn
from decodegraph.layers.layernorm import RMSNorm
from decodegraph.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from decodegraph.layers.rotary_embedding import apply_rotary_emb, get_rope, get_rope_parameters
from decodegraph.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from decodegraph.models.llama import layer_sliding_window
from decodegraph.models.weights import load_stacked_weights


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight): the checkpoint stores the offset from 1, which
    `process_weights_after_loading` adds once, so the forward is a plain RMSNorm."""

    def process_weights_after_loading(self) -> None:
        with torch.no_grad():
            self.weight.add_(1.0)


def _layer_types(config: PretrainedConfig) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:  # Gemma 2 before layer_types: sliding on even layers
        types = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(config.num_hidden_layers)
        ]
    return list(types)


def _rope_parameters(config: PretrainedConfig) -> dict[str, dict]:
    """Rope settings per layer type: Gemma 3 keeps one per type, Gemma 2 one for all."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return {
            layer_type: get_rope_parameters(_FlatRope(config, p))
            for layer_type, p in params.items()
        }
    flat = get_rope_parameters(config)
    return {layer_type: flat for layer_type in set(_layer_types(config))}


class _FlatRope:
    """A config view with one layer type's rope parameters (for get_rope_parameters)."""

    def __init__(self, config: PretrainedConfig, params: dict) -> None:
        self.rope_parameters = params
        self.max_position_embeddings = config.max_position_embeddings
        self.partial_rotary_factor = getattr(config, "partial_rotary_factor", None)


class GemmaAttention(nn.Module):
    """Stacked qkv projection, (per-head q/k norm,) rope, paged `Attention`, o_proj."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias
        )
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            config.query_pre_attn_scalar**-0.5,
            self.num_kv_heads,
            layer_idx,
            sliding_window=layer_sliding_window(config, layer_idx),
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        t = qkv.shape[0]
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            t, self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary_emb(q, cos, sin).reshape(t, self.q_size)
        k = apply_rotary_emb(k, cos, sin).reshape(t, self.kv_size)
        return self.o_proj(self.attn(q, k, v))


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) with gate and up stacked into one projection."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], False)
        self.act_fn = get_act_and_mul_fn(config.hidden_activation)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Norm, attention, norm; norm, MLP, norm; the residual stream carried through the
    fused-add norms before attention and before the MLP."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, qk_norm: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_type = _layer_types(config)[layer_idx]
        self.self_attn = GemmaAttention(config, layer_idx, qk_norm)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

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
        hidden_states = self.post_attention_layernorm(self.self_attn(hidden_states, cos, sin))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers and final norm; returns normed hidden states."""

    def __init__(self, config: PretrainedConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, qk_norm) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # transformers multiplies by sqrt(hidden_size) rounded to the model dtype.
        normalizer = torch.tensor(config.hidden_size**0.5, dtype=torch.get_default_dtype())
        self.register_buffer("normalizer", normalizer, persistent=False)
        self.rotary_emb = nn.ModuleDict(
            {
                layer_type: get_rope(config.head_dim, config.max_position_embeddings, params)
                for layer_type, params in _rope_parameters(config).items()
            }
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) * self.normalizer
        cos_sin = {name: rope.get_cos_sin(positions) for name, rope in self.rotary_emb.items()}
        residual = None
        for layer in self.layers:
            cos, sin = cos_sin[layer.layer_type]
            hidden_states, residual = layer(hidden_states, residual, cos, sin)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(nn.Module):
    """Gemma 2: soft-capped attention scores and logits, no q/k norm."""

    qk_norm = False

    def __init__(self, hf_config: PretrainedConfig, max_model_len: int | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.model = GemmaModel(hf_config, self.qk_norm)
        # Gemma checkpoints tie the LM head to the embedding.
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] for flattened token ids [T] at `positions` [T]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab], soft-capped where the config says."""
        logits = torch.nn.functional.linear(hidden_states, self.lm_head.weight).float()
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the parameters (see models/weights.py)."""
        return load_stacked_weights(self, weights, self.tie_word_embeddings)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text only): RMSNorm over each head of q and k, and a rope base per
    layer type (`rope_parameters` keyed by "sliding_attention" and "full_attention")."""

    qk_norm = True
