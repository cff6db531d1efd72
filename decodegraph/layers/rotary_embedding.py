"""Rotary position embedding (neox / Hugging Face layout) with a precomputed cache.

The cos/sin table covers every position up to `max_position_embeddings` and is indexed
by `positions`, so a forward has no host work and its shapes depend only on the token
count (docs/design.md §4). Frequencies follow transformers' `modeling_rope_utils` for the rope
types supported here (default, linear, llama3, yarn), so logits match it numerically.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from decodegraph.layers.triton_ops import fused_ops_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def get_rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of a config as one flat dict with `rope_type` and `rope_theta`.

    transformers 5 keeps them in `config.rope_parameters` (theta included); 4.x keeps
    `config.rope_theta` beside an optional `config.rope_scaling` (with `type` or
    `rope_type`). Both spellings are accepted. Where they are kept per layer type
    (Gemma 3: one dict per "sliding_attention" and "full_attention"), `layer_type` picks
    one; flat settings hold for every layer type.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        if layer_type is None:
            raise NotImplementedError(
                f"per-layer-type rope_parameters ({sorted(params)}) are not supported"
            )
        params = dict(params[layer_type])
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.pop("type", None)
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    prf = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if prf not in (None, 1, 1.0):
        raise NotImplementedError(f"partial_rotary_factor {prf} is not supported (only 1.0)")
    return params


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(params: dict[str, Any], dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(
    params: dict[str, Any], dim: int, max_position: int
) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    orig_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / orig_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    params: dict[str, Any], head_size: int, max_position: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32) and the cos/sin scale for one rope setting."""
    rope_type = params["rope_type"]
    if rope_type == "default":
        return _default_inv_freq(params["rope_theta"], head_size), 1.0
    if rope_type == "linear":
        return _default_inv_freq(params["rope_theta"], head_size) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(params, head_size), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, head_size, max_position)
    raise NotImplementedError(
        f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [T, H, D] with `cos`/`sin` [T, 1, D] from `RotaryEmbedding.get_cos_sin`.

    `sin` carries the sign of rotate-half in its first half, so rotate-half is a single
    roll (one op, no negation, no concatenation). On CPU in float32 this is one native
    operator with the same arithmetic (graph traces decompose it again), on CUDA one
    Triton kernel (layers/triton_ops.py).
    """
    ops = fused_ops_for(x)
    if ops is not None:
        return ops.rotary_embedding(x, cos, sin)
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over a cached [max_position, 2, head_size] cos/sin table."""

    def __init__(
        self, head_size: int, max_position: int, inv_freq: torch.Tensor, scaling: float = 1.0
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.max_position = max_position
        # Same float32 arithmetic as transformers' rotary forward, on the host, then cast to
        # the model dtype and moved to the device the model is being built on.
        target = torch.get_default_device()
        with torch.device("cpu"):
            inv_freq = inv_freq.to(device="cpu", dtype=torch.float32)
            pos = torch.arange(max_position, dtype=torch.int64).float()
            freqs = pos[:, None] * inv_freq[None, :]
            cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
            cache = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)
        cache = cache.to(device=target, dtype=torch.get_default_dtype())
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def get_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `positions` [T], each [T, 1, head_size]; compute once per
        forward and share across layers."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        return cos_sin[:, 0:1], cos_sin[:, 1:2]

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM-style call: rotate query [T, Hq*D] and key [T, Hk*D] at `positions`."""
        cos, sin = self.get_cos_sin(positions)
        t = positions.shape[0]
        q = apply_rotary_emb(query.view(t, -1, self.head_size), cos, sin)
        k = apply_rotary_emb(key.view(t, -1, self.head_size), cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)


def get_rope(head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> RotaryEmbedding:
    """A rotary embedding for `rope_parameters` as returned by `get_rope_parameters`."""
    with torch.device("cpu"):
        inv_freq, scaling = compute_inv_freq(rope_parameters, head_size, max_position)
    return RotaryEmbedding(head_size, max_position, inv_freq, scaling)
