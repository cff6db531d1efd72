"""The pointwise and norm layers as one Triton kernel each, on CUDA: RMSNorm (with the
residual add fused in), rotary embedding and SiLU-and-mul, the GPU counterparts of the CPU
operators in decodegraph/native.

In torch ops each of these is two to five kernels (a norm, an add, a roll, multiplies), and
a replayed decode graph of a small model at batch 1 spends more device time between such
tiny kernels than in them (docs/performance.md, "GPU"). Each op here reads its inputs once
and computes in float32, rounding once to the activation's dtype; a fused residual add
rounds the sum to that dtype first, as the separate add does, since that sum is the
residual stream the next layer reads.

The kernels are torch custom ops (`torch.ops.decodegraph_cuda.*`) so that graph traces
(make_fx, for piecewise graphs) record them as calls. The layers ask `fused_ops_for(x)`:
the CPU operators, else these kernels where they apply (a CUDA tensor, triton installed,
DECODEGRAPH_CUDA_FUSED_OPS not "0"). The launchers (`launch_*`) take CPU tensors too, for
Triton's interpreter (tests/layers/test_triton_ops.py).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from decodegraph.native import cpu_ops_for

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: cuda_ops_for() returns None
    triton = None


if triton is not None:

    @triton.jit
    def _rms_norm(
        x,
        x_stride,
        residual,
        residual_stride,
        residual_out,
        weight,
        out,
        eps,
        N,
        BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
    ):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        live = c < N
        v = tl.load(x + row * x_stride + c, mask=live, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(residual + row * residual_stride + c, mask=live, other=0.0)
            summed = (v + r.to(tl.float32)).to(residual_out.dtype.element_ty)
            tl.store(residual_out + row * N + c, summed, mask=live)
            v = summed.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / N + eps)
        w = tl.load(weight + c, mask=live, other=0.0).to(tl.float32)
        tl.store(out + row * N + c, (v * inv_rms * w).to(out.dtype.element_ty), mask=live)

    @triton.jit
    def _silu_and_mul(x, x_stride, out, D, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < D
        gate = tl.load(x + row * x_stride + c, mask=live, other=0.0).to(tl.float32)
        up = tl.load(x + row * x_stride + D + c, mask=live, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out + row * D + c, y.to(out.dtype.element_ty), mask=live)

    @triton.jit
    def _rotary(
        x,
        x_stride_t,
        x_stride_h,
        cos,
        cos_stride,
        sin,
        sin_stride,
        out,
        H,
        D,
        D_PAD: tl.constexpr,
        HEADS: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        live = (h < H) & (d < D)
        src = x + t * x_stride_t + h * x_stride_h
        v = tl.load(src + d, mask=live, other=0.0).to(tl.float32)
        # rotate-half as a roll by D / 2: `sin` carries rotate-half's sign (get_cos_sin).
        partner = tl.load(src + (d + D // 2) % D, mask=live, other=0.0).to(tl.float32)
        c = tl.load(cos + t * cos_stride + d, mask=d < D, other=0.0).to(tl.float32)
        s = tl.load(sin + t * sin_stride + d, mask=d < D, other=0.0).to(tl.float32)
        y = v * c + partner * s
        tl.store(out + (t * H + h) * D + d, y.to(out.dtype.element_ty), mask=live)


def launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rms_norm(x [+ residual]) * weight over rows of x [T, N] (last dim contiguous);
    returns (out, x + residual) with a residual, else (out, None)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if t:
        _rms_norm[(t,)](
            x,
            x.stride(0),
            residual if residual is not None else x,
            residual.stride(0) if residual is not None else 0,
            res_out,
            weight,
            out,
            eps,
            n,
            BLOCK=triton.next_power_of_2(n),
            HAS_RESIDUAL=residual is not None,
            num_warps=4 if n <= 4096 else 8,
        )
    return out, (res_out if residual is not None else None)


def launch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x [T, 2d] (last dim contiguous) -> [T, d]."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    if t:
        _silu_and_mul[(t, triton.cdiv(d, block))](x, x.stride(0), out, d, BLOCK=block)
    return out


def launch_rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + roll(x, D / 2) * sin for x [T, H, D] (head dim contiguous) and cos/sin
    [T, 1, D] -> a contiguous [T, H, D]."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    d_pad = triton.next_power_of_2(d)
    heads = min(triton.next_power_of_2(h), max(1, 2048 // d_pad))
    if t:
        _rotary[(t, triton.cdiv(h, heads))](
            x,
            x.stride(0),
            x.stride(1),
            cos,
            cos.stride(0),
            sin,
            sin.stride(0),
            out,
            h,
            d,
            D_PAD=d_pad,
            HEADS=heads,
        )
    return out


@cache
def _register() -> object:
    """The custom ops, defined on first use (where triton is installed)."""

    @torch.library.custom_op("decodegraph_cuda::rms_norm", mutates_args=())
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return launch_rms_norm(x, weight, eps)[0]

    @rms_norm.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x.new_empty(x.shape)

    @torch.library.custom_op("decodegraph_cuda::fused_add_rms_norm", mutates_args=())
    def fused_add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, res = launch_rms_norm(x, weight, eps, residual)
        return out, res

    @fused_add_rms_norm.register_fake
    def _(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.custom_op("decodegraph_cuda::silu_and_mul", mutates_args=())
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return launch_silu_and_mul(x)

    @silu_and_mul.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.custom_op("decodegraph_cuda::rotary_embedding", mutates_args=())
    def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return launch_rotary_embedding(x, cos, sin)

    @rotary_embedding.register_fake
    def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape)

    return torch.ops.decodegraph_cuda


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@cache
def _enabled() -> bool:
    return triton is not None and os.environ.get("DECODEGRAPH_CUDA_FUSED_OPS", "1") != "0"


def cuda_ops_for(x: torch.Tensor) -> object | None:
    """`torch.ops.decodegraph_cuda` where its kernels apply to `x` (on CUDA, a float
    dtype, triton installed, not switched off), else None."""
    if x.device.type != "cuda" or x.dtype not in _DTYPES or not _enabled():
        return None
    return _register()


def fused_ops_for(x: torch.Tensor) -> object | None:
    """The fused norm, rotary and activation ops for `x`'s device: decodegraph's CPU
    operators (float32 on the CPU), these Triton kernels (CUDA), else None (torch ops)."""
    return cpu_ops_for(x) or cuda_ops_for(x)
