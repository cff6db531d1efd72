"""decodegraph's CPU operators split large inputs over torch's intra-op threads: each
row is computed by exactly one thread, so every split gives the bits of one thread.
The batch-1 projection is as exact as BLAS's, and the layers use it at batch 1."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def _ops(cpu_ops: object) -> dict[str, Callable[[], object]]:
    """Inputs of 2048 rows (several grain sizes for every op), strided where allowed."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(2048, 2 * 344 + 8, generator=gen)
    x, res = wide[:, :64], torch.randn(2048, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    qk = wide[:, : 12 * 8].view(2048, 12, 8)
    cos, sin = torch.randn(2048, 8, generator=gen), torch.randn(2048, 8, generator=gen)
    weight, bias = torch.randn(4099, 344, generator=gen), torch.randn(4099, generator=gen)
    return {
        "linear_one_row": lambda: cpu_ops.linear_one_row(wide[:1, :344], weight, bias),
        "silu_and_mul": lambda: cpu_ops.silu_and_mul(wide[:, : 2 * 344]),
        "rms_norm": lambda: cpu_ops.rms_norm(x, w, 1e-5),
        "fused_add_rms_norm": lambda: cpu_ops.fused_add_rms_norm(x, res, w, 1e-5),
        "rotary_embedding": lambda: cpu_ops.rotary_embedding(qk, cos, sin),
    }


@pytest.mark.parametrize(
    "op", ["linear_one_row", "silu_and_mul", "rms_norm", "fused_add_rms_norm", "rotary_embedding"]
)
def test_row_wise_operators_give_the_same_bits_on_any_number_of_threads(
    cpu_ops: object, op: str, restore_threads: None
) -> None:
    run = _ops(cpu_ops)[op]
    torch.set_num_threads(1)
    want = run()
    results = []
    for n in (2, 3):
        torch.set_num_threads(n)
        results.append(run())
    for got in results:
        for a, b in zip(
            want if isinstance(want, tuple) else (want,),
            got if isinstance(got, tuple) else (got,),
            strict=True,
        ):
            assert torch.equal(a, b)


@pytest.mark.parametrize("k", [1, 7, 16, 344, 4864])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 1001])
def test_the_batch_1_projection_is_as_exact_as_blas(cpu_ops: object, k: int, n: int) -> None:
    """Against a float64 product: no further from it than four times BLAS's error (the
    sums run in another order), bias included."""
    gen = torch.Generator().manual_seed(k * 7 + n)
    x, w, b = (
        torch.randn(1, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
    )
    exact = x.double() @ w.double().t() + b.double()
    ours = (cpu_ops.linear_one_row(x, w, b).double() - exact).abs().max().item()
    blas = ((torch.addmm(b, x, w.t())).double() - exact).abs().max().item()
    assert ours <= 4 * blas + 1e-5
    with pytest.raises(RuntimeError, match="linear_one_row"):
        cpu_ops.linear_one_row(torch.randn(2, k), w, None)  # one row only


def test_layers_take_the_batch_1_projection_in_eager_steps_and_in_graphs(cpu_ops: object) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from decodegraph.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(256, 384, bias=True)  # over the size that keeps mm
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    layer.process_weights_after_loading()
    x1, x2 = torch.randn(1, 256), torch.randn(2, 256)
    assert torch.allclose(layer(x1), torch.addmm(layer.bias, x1, layer.weight.t()), atol=1e-5)
    traced = make_fx(layer)(x1).graph
    assert any("linear_one_row" in str(n.target) for n in traced.nodes)
    assert not any("linear_one_row" in str(n.target) for n in make_fx(layer)(x2).graph.nodes)
    small = ReplicatedLinear(64, 96)
    small.process_weights_after_loading()
    assert small.one_row is None
