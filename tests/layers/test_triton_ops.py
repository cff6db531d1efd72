"""The CUDA layers' Triton kernels (layers/triton_ops.py) against the torch-op formulas
they replace: in Triton's interpreter on the CPU (a child pytest, tests/utils/triton.py),
and compiled on a GPU where one is present."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.utils.triton import INTERPRETED, run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, cos, sin = x.float(), cos.float(), sin.float()
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[:, :d].float()) * x[:, d:].float()


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}


def check_all(ops: dict[str, Callable], device: str, dtype: torch.dtype) -> None:
    """Each op on strided inputs (views into a wider tensor, as the model passes them)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    tol = _tolerance(dtype)
    for t, n in [(1, 64), (5, 96), (3, 2048)]:
        wide, res, w = randn(t, n + 8), randn(t, n), randn(n)
        x = wide[:, :n]
        torch.testing.assert_close(
            ops["rms_norm"](x, w, 1e-6).float(), rms_norm_ref(x, w, 1e-6), **tol
        )
        out, summed = ops["fused_add_rms_norm"](x, res, w, 1e-6)
        assert summed.dtype == dtype
        # The sum is rounded to the activation's dtype, as the separate add rounds it.
        assert torch.equal(summed, x + res)
        torch.testing.assert_close(out.float(), rms_norm_ref(summed, w, 1e-6), **tol)
    for t, d in [(1, 16), (4, 688), (3, 2500)]:
        x = randn(t, 2 * d + 4)[:, : 2 * d]
        torch.testing.assert_close(ops["silu_and_mul"](x).float(), silu_and_mul_ref(x), **tol)
    for t, h, d in [(1, 3, 8), (4, 12, 64), (2, 40, 128), (3, 5, 80)]:
        qkv = randn(t, (h + 2) * d)  # the stacked projection: q and k rotate as a view
        x = qkv[:, : h * d].view(t, h, d)
        cos_sin = randn(t, 2, d)
        cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
        got = ops["rotary_embedding"](x, cos, sin)
        assert got.shape == (t, h, d) and got.is_contiguous()
        torch.testing.assert_close(got.float(), rotary_ref(x, cos, sin), **tol)


if not INTERPRETED:

    def test_the_kernels_in_the_interpreter() -> None:
        run_interpreted(__file__, timeout=600)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_the_custom_ops_on_the_gpu(dtype: torch.dtype) -> None:
        from decodegraph.layers.triton_ops import cuda_ops_for

        ops = cuda_ops_for(torch.empty(1, device="cuda", dtype=dtype))
        assert ops is not None
        names = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"]
        check_all({n: getattr(ops, n) for n in names}, "cuda", dtype)

    def test_the_layers_take_them_on_cuda_tensors_only() -> None:
        from decodegraph.layers.triton_ops import cuda_ops_for

        assert cuda_ops_for(torch.empty(1)) is None
        if HAS_TRITON and torch.cuda.is_available():
            assert cuda_ops_for(torch.empty(1, device="cuda")) is not None

else:
    from decodegraph.layers import triton_ops

    LAUNCHERS = {
        "rms_norm": lambda x, w, eps: triton_ops.launch_rms_norm(x, w, eps)[0],
        "fused_add_rms_norm": lambda x, r, w, eps: triton_ops.launch_rms_norm(x, w, eps, r),
        "silu_and_mul": triton_ops.launch_silu_and_mul,
        "rotary_embedding": triton_ops.launch_rotary_embedding,
    }

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_each_kernel_matches_its_formula(dtype: torch.dtype) -> None:
        check_all(LAUNCHERS, "cpu", dtype)
