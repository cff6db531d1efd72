"""Gemma 2 and Gemma 3 (text): sliding-window and full-attention layers in one model.

What differs from the Llama family: RMSNorm scales by (1 + weight); four norms per layer
(before and after attention, before and after the MLP); a gelu-tanh gated MLP;
embeddings scaled by sqrt(hidden_size); attention scaled by `query_pre_attn_scalar`
rather than the head size. Gemma 2 caps attention scores and the final logits with
tanh (soft-capping); Gemma 3 norms each head of q and k and rotates its sliding layers
with a rope base of their own. `layer_types` says which layers attend through a
sliding window; the model runner gives each kind its own attention group and KV cache.
The attention and MLP blocks are Llama's (llama.py), set up by `attention_options`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers import PretrainedConfig

from decodegraph.layers.layernorm import RMSNorm
from decodegraph.layers.rotary_embedding import get_rope, get_rope_parameters
from decodegraph.layers.vocab import VocabParallelEmbedding
from decodegraph.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP


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


class GemmaDecoderLayer(nn.Module):
    """Norm, attention, norm; norm, MLP, norm; the residual stream carried through the
    fused-add norms before attention and before the MLP."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, layer_idx: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_type = _layer_types(config)[layer_idx]
        window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.self_attn = LlamaAttention(config, options, layer_idx, window)
        self.mlp = LlamaMLP(config, config.hidden_activation)
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

    def __init__(self, config: PretrainedConfig, options: AttentionOptions) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, options, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # transformers multiplies by sqrt(hidden_size) rounded to the model dtype.
        normalizer = torch.tensor(config.hidden_size**0.5, dtype=torch.get_default_dtype())
        self.register_buffer("normalizer", normalizer, persistent=False)
        # One rope per distinct setting (Gemma 2 has one for both layer types), so each
        # forward gathers cos/sin once per setting; `layer_rope[i]` is layer i's.
        params = [get_rope_parameters(config, layer.layer_type) for layer in self.layers]
        distinct = [p for i, p in enumerate(params) if p not in params[:i]]
        self.rotary_emb = nn.ModuleList(
            get_rope(config.head_dim, config.max_position_embeddings, p) for p in distinct
        )
        self.layer_rope = [distinct.index(p) for p in params]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) * self.normalizer
        cos_sin = [rope.get_cos_sin(positions) for rope in self.rotary_emb]
        residual = None
        for layer, rope in zip(self.layers, self.layer_rope, strict=True):
            cos, sin = cos_sin[rope]
            hidden_states, residual = layer(hidden_states, residual, cos, sin)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: soft-capped attention scores and logits, no q/k norm."""

    model_class = GemmaModel
    tie_word_embeddings_default = True  # Gemma checkpoints tie the LM head to the embedding

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__(hf_config)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=False,
            scale=config.query_pre_attn_scalar**-0.5,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
            norm=GemmaRMSNorm,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab], soft-capped where the config says."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text only): RMSNorm over each head of q and k, and a rope base per
    layer type (`rope_parameters` keyed by "sliding_attention" and "full_attention")."""

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return dataclasses.replace(super().attention_options(config), qk_norm=True)
