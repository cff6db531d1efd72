"""Gated activation of a stacked gate_up output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decodegraph.layers.activation import get_act_and_mul_fn


def test_silu_and_mul_gates_the_second_half_with_the_first() -> None:
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    out = get_act_and_mul_fn("silu")(torch.cat((gate, up), dim=-1))
    torch.testing.assert_close(out, F.silu(gate) * up)


def test_unsupported_activation_is_refused_by_name() -> None:
    with pytest.raises(NotImplementedError, match="'gelu' is not supported"):
        get_act_and_mul_fn("gelu")
