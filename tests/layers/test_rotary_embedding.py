"""Rope frequencies and rotation against transformers' own functions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from decodegraph.layers.rotary_embedding import (
    apply_rotary_emb,
    compute_inv_freq,
    get_rope,
    get_rope_parameters,
)
from decodegraph.platforms.base import trace
from decodegraph.platforms.cpu import CpuPlatform

HEAD_DIM = 32
ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "mscale": 0.7,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "original_max_position_embeddings": 128,
    },
    "yarn-untruncated": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "attention_factor": 1.3,
        "truncate": False,
        "original_max_position_embeddings": 256,
    },
}


def config_for(rope: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        rope_parameters=dict(rope),
    )


@pytest.mark.parametrize("name", list(ROPES))
def test_inverse_frequencies_match_transformers(name: str) -> None:
    config = config_for(ROPES[name])
    params = get_rope_parameters(config)
    got, got_scale = compute_inv_freq(params, HEAD_DIM, 512)
    rope_type = params["rope_type"]
    if rope_type == "default":
        want, want_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got_scale == pytest.approx(want_scale)


@pytest.mark.parametrize("name", ["default", "llama3", "yarn-mscale"])
def test_rotation_at_positions_matches_transformers(name: str) -> None:
    config = config_for(ROPES[name])
    ours = get_rope(HEAD_DIM, 512, get_rope_parameters(config))
    theirs = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 7, 300, 511])
    q, k = torch.randn(5, 4, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    cos, sin = theirs(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(
        q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin
    )
    got_q, got_k = ours(positions, q.reshape(5, -1), k.reshape(5, -1))
    torch.testing.assert_close(
        got_q, want_q.transpose(1, 2)[0].reshape(5, -1), atol=1e-6, rtol=1e-6
    )
    torch.testing.assert_close(
        got_k, want_k.transpose(1, 2)[0].reshape(5, -1), atol=1e-6, rtol=1e-6
    )


def test_rotation_preserves_norm_and_position_zero_is_identity() -> None:
    rope = get_rope(HEAD_DIM, 64, ROPES["default"])
    x = torch.randn(3, 2, HEAD_DIM)
    cos, sin = rope.get_cos_sin(torch.tensor([0, 5, 63]))
    y = apply_rotary_emb(x, cos, sin)
    torch.testing.assert_close(y[0], x[0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_transformers_4_style_rope_scaling_and_theta_are_read() -> None:
    class OldConfig:  # the attribute layout transformers 4.x configs have
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}
        max_position_embeddings = 64

    assert get_rope_parameters(OldConfig()) == {
        "rope_type": "linear",
        "factor": 2.0,
        "rope_theta": 1234.0,
    }


def test_dynamic_rope_is_refused_by_name() -> None:
    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(NotImplementedError, match="'dynamic' is not supported"):
        compute_inv_freq(params, HEAD_DIM, 64)


def test_cache_is_in_the_default_dtype_at_construction() -> None:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        rope = get_rope(HEAD_DIM, 16, ROPES["default"])
    finally:
        torch.set_default_dtype(prev)
    assert rope.cos_sin_cache.dtype == torch.bfloat16
    assert rope.cos_sin_cache.shape == (16, 2, HEAD_DIM)


@pytest.mark.parametrize(
    "head_dim, heads",
    [(HEAD_DIM, 6), (8, 12), (8, 3), (8, 1), (4, 5), (4, 2), (16, 3), (64, 2), (128, 3), (48, 2)],
    ids=str,
)
@pytest.mark.parametrize("adjacent_heads", [True, False])
def test_the_native_rotation_equals_the_tensor_formula_bit_for_bit(
    cpu_ops: object, head_dim: int, heads: int, adjacent_heads: bool
) -> None:
    """On the strided rows a stacked qkv projection gives (q and k heads side by side),
    and on heads further apart (per-head norms' outputs are not always adjacent): head
    sizes whose heads pack a vector (4, 8, 16), whose halves fill vectors (64, 128), and
    neither (48); head counts that leave a partial vector; and one token alone, whose
    first vector is its last."""
    rope = get_rope(head_dim, 512, get_rope_parameters(config_for(ROPES["llama3"])))
    stride = head_dim if adjacent_heads else 2 * head_dim
    qkv = torch.randn(6, (heads + 1) * stride) * 5
    x = qkv[:, : heads * stride].view(6, heads, stride)[:, :, :head_dim]
    cos, sin = rope.get_cos_sin(torch.tensor([0, 3, 9, 100, 256, 511]))
    want = x * cos + torch.roll(x, head_dim // 2, -1) * sin
    assert torch.equal(cpu_ops.rotary_embedding(x, cos, sin), want)
    assert torch.equal(cpu_ops.rotary_embedding(x[2:3], cos[2:3], sin[2:3]), want[2:3])


def test_rotation_runs_the_native_operator_eagerly_and_aten_ops_in_a_graph(
    cpu_ops: object,
) -> None:
    rope = get_rope(HEAD_DIM, 64, ROPES["default"])
    x, positions = torch.randn(3, 2, HEAD_DIM), torch.tensor([1, 5, 63])

    def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rotary_emb(x, *rope.get_cos_sin(positions))

    with torch.profiler.profile() as prof:
        rotate(x, positions)
    assert "decodegraph_cpu::rotary_embedding" in {e.name for e in prof.events()}
    gm = trace(rotate, [x, positions], CpuPlatform().graph_decompositions())
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("decodegraph_cpu" in t for t in targets), targets
    assert torch.equal(gm(x, positions), rotate(x, positions))
