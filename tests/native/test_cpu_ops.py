"""decodegraph's CPU operators split large inputs over torch's intra-op threads: each
row is computed by exactly one thread, so every split gives the bits of one thread."""

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
    return {
        "silu_and_mul": lambda: cpu_ops.silu_and_mul(wide[:, : 2 * 344]),
        "rms_norm": lambda: cpu_ops.rms_norm(x, w, 1e-5),
        "fused_add_rms_norm": lambda: cpu_ops.fused_add_rms_norm(x, res, w, 1e-5),
        "rotary_embedding": lambda: cpu_ops.rotary_embedding(qk, cos, sin),
    }


@pytest.mark.parametrize(
    "op", ["silu_and_mul", "rms_norm", "fused_add_rms_norm", "rotary_embedding"]
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
