"""Every kernel launch TRITON_ATTN can make, compiled for sm_90 (H100/H200) on a CPU.

The interpreter (test_triton_attn.py) checks what the kernels compute, not that they
compile, nor what they cost in registers. Here the backend's own `forward` runs for a
representative set of shapes with every launch recorded instead of run; each distinct
(kernel, signature, constexprs, options) is compiled down to a cubin by the ptxas the
triton wheel ships, and ptxas's report gives registers and spills per variant. Run with
`-rP` to see the table.

As in test_triton_attn.py, triton is imported only in a child process (`python -m
tests.attention.test_triton_compile`), with .triton/ on its PYTHONPATH where triton is
not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tests.utils.triton import NO_TRITON, TRITON_DIR, env_with_triton, triton_findable

ROOT = Path(__file__).resolve().parents[2]
# sm_90: the H100/H200 this backend targets first.
CAPABILITY = 90
# Kernels that run once per token in every decode step may not spill at all; prefill
# tiles are larger and a small spill there costs little next to their arithmetic.
MAX_SPILL_BYTES = {"_prefill_attention": 256}


class Shape(NamedTuple):
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    sliding_window: int | None = None
    logits_soft_cap: float | None = None


def _shapes() -> list[Shape]:
    # Every dtype x head size x block size at a group of 4 (Llama 3's 32 heads on 8 KV
    # heads), then groups 1 and 8, then sliding windows and soft caps.
    shapes = [
        Shape(dtype, 32, 8, head, block)
        for dtype in (torch.float32, torch.bfloat16)
        for head in (64, 128)
        for block in (16, 32)
    ]
    shapes += [
        Shape(dtype, 8 * group, 8, head, block)
        for dtype, head, block in ((torch.bfloat16, 128, 16), (torch.float32, 64, 32))
        for group in (1, 8)
    ]
    return shapes + [
        # Gemma 2 (window and cap) and Gemma 3 (window only), at head size 256.
        Shape(torch.bfloat16, 8, 4, 256, 16, 4096, 50.0),
        Shape(torch.bfloat16, 4, 1, 256, 16, 512),
        Shape(torch.bfloat16, 32, 8, 128, 32, None, 30.0),
        Shape(torch.float32, 32, 8, 64, 16, 1024, 50.0),
        # Blocks of several tiles.
        Shape(torch.bfloat16, 32, 8, 128, 128),
        # The models the CUDA checks run: the tiny Llama preset, stories260K.
        Shape(torch.float32, 8, 4, 32, 16),
        Shape(torch.float32, 8, 4, 8, 16),
    ]


# Batches per shape: (padded tokens, uniform decode). A batch-1 decode (the split path
# at its most segments) and one large enough for one segment (unsplit); a small mixed
# batch (the prefill kernel split) and a large one.
MAX_NUM_REQS = 256
_BATCHES = {
    "decode-1": (1, True),
    "decode-256": (256, True),
    "mixed-8": (8, False),
    "mixed-512": (512, False),
}


def _launches(shape: Shape) -> list[tuple[str, object, tuple, dict]]:
    """(batch, kernel, args, kwargs) of every launch forward makes for `shape`."""
    import triton

    from decodegraph.attention.backends.base import AttentionMetadata
    from decodegraph.attention.backends.triton_attn import TritonAttentionBackend

    calls: list[tuple[object, tuple, dict]] = []

    def record(kernel: object, grid: object) -> object:
        return lambda *args, **kwargs: calls.append((kernel, args, kwargs))

    backend = TritonAttentionBackend(
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_size,
        shape.head_size**-0.5,
        shape.block_size,
        4096,
        shape.sliding_window,
        shape.logits_soft_cap,
    )
    cache_shape = backend.get_kv_cache_shape(
        8, shape.block_size, shape.num_kv_heads, shape.head_size
    )
    cache = torch.empty(cache_shape, dtype=shape.dtype)
    backend.bind_kv_caches([(cache, cache)])
    backend.allocate_workspace(MAX_NUM_REQS, shape.dtype, torch.device("cpu"))
    jit = triton.runtime.jit.JITFunction
    original = jit.__getitem__
    jit.__getitem__ = record
    recorded = []
    try:
        for batch, (tokens, uniform) in _BATCHES.items():
            reqs = tokens if uniform else MAX_NUM_REQS
            md = AttentionMetadata(
                num_reqs=reqs,
                num_actual_tokens=tokens,
                max_query_len=1 if uniform else tokens,
                max_seq_len=1,
                uniform_decode=uniform,
                query_start_loc_cpu=[],
                seq_lens_cpu=[],
                query_start_loc=torch.zeros(reqs + 1, dtype=torch.int32),
                seq_lens=torch.zeros(reqs, dtype=torch.int32),
                block_tables=torch.zeros(reqs, backend.max_blocks_per_seq, dtype=torch.int32),
                slot_mapping=torch.zeros(tokens, dtype=torch.int64),
            )
            backend.set_eager_metadata(md)
            # A fused QKV projection's output, split: q/k/v rows are strided views.
            qd, kvd = shape.num_heads * shape.head_size, shape.num_kv_heads * shape.head_size
            qkv = torch.empty(tokens, qd + 2 * kvd, dtype=shape.dtype)
            q, k, v = qkv.split([qd, kvd, kvd], dim=1)
            backend.forward(q, k, v, torch.empty(tokens, qd, dtype=shape.dtype), 0, 0)
            recorded += [(batch, *call) for call in calls]
            calls.clear()
    finally:
        jit.__getitem__ = original
    return recorded


_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _source(kernel: object, args: tuple, kwargs: dict) -> tuple[object, dict, str]:
    """An ASTSource as the JIT would specialise this launch on a GPU: pointers and ints
    divisible by 16 get that hint (CUDA allocations are 16-byte aligned), ints equal to
    1 become constants; returns (source, options, constexprs as text)."""
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, arg) in enumerate(zip(names, args, strict=False)):
        if isinstance(arg, torch.Tensor):
            signature[name] = _POINTER_TYPES[arg.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(arg, bool) or isinstance(arg, int) and arg == 1:
            signature[name], constexprs[name] = "constexpr", arg
        elif isinstance(arg, int):
            signature[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
            if arg % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    for name, value in kwargs.items():
        if name not in options:
            signature[name], constexprs[name] = "constexpr", value
    shown = {k: v for k, v in constexprs.items() if k in kwargs}
    text = " ".join(f"{k}={v}" for k, v in shown.items())
    return (
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        options,
        text,
    )


_USED = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


class Variant(NamedTuple):
    kernel: str
    dtype: str
    batch: str
    constexprs: str
    source: object
    options: dict


class Compiled(NamedTuple):
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int  # bytes of shared memory


# What the compile workers read (they fork from the process that fills it).
_VARIANTS: list[Variant] = []


def _variants() -> list[Variant]:
    """Every distinct launch of every shape."""
    seen, variants = set(), []
    for shape in _shapes():
        dtype = str(shape.dtype).removeprefix("torch.")
        for batch, kernel, args, kwargs in _launches(shape):
            src, options, text = _source(kernel, args, kwargs)
            key = (kernel.__name__, tuple(sorted(src.signature.items())), text, str(options))
            if key not in seen:
                seen.add(key)
                variants.append(Variant(kernel.__name__, dtype, batch, text, src, options))
    return variants


def _compile(index: int) -> Compiled | str:
    """Variant `index` compiled, or why it did not compile."""
    import triton
    from triton.backends.compiler import GPUTarget

    variant = _VARIANTS[index]
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas -v
            kernel = triton.compile(
                variant.source, target=GPUTarget("cuda", CAPABILITY, 32), options=variant.options
            )
    except Exception as e:  # noqa: BLE001  (every compile error is a failure to report)
        return f"{type(e).__name__}: {str(e)[-2000:]}"
    report = log.getvalue()
    if _USED.search(report) is None:  # a triton without TRITON_DUMP_PTXAS_LOG
        report = _ptxas_report(kernel.asm["ptx"])
    used, spills = _USED.search(report), _SPILLS.search(report)
    if used is None or spills is None:
        return f"no ptxas report: {report[-500:]}"
    stores, loads = int(spills.group(1)), int(spills.group(2))
    return Compiled(int(used.group(1)), stores, loads, kernel.metadata.shared)


def _ptxas_report(ptx: str) -> str:
    """ptxas -v's report on `ptx` from a ptxas of the wheel's that reads its version
    (3.9 compiles sm_90 with ptxas-blackwell, earlier wheels with ptxas)."""
    report = ""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        for name in ("ptxas-blackwell", "ptxas"):
            ptxas = _ptxas().with_name(name)
            if ptxas.is_file():
                cmd = [
                    str(ptxas),
                    "-v",
                    f"--gpu-name=sm_{CAPABILITY}a",
                    str(source),
                    "-o",
                    os.devnull,
                ]
                report = subprocess.run(cmd, capture_output=True, text=True).stderr
                if _USED.search(report):
                    break
    return report


def compile_all(workers: int = 2) -> int:
    """Compile every variant; print a table; return the number of failures."""
    import multiprocessing

    import triton

    _VARIANTS[:] = _variants()
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        results = pool.map(_compile, range(len(_VARIANTS)))
    failures = 0
    print(f"triton {triton.__version__}, sm_{CAPABILITY}: registers, spill bytes, shared bytes")
    print(
        f"{'kernel':<19} {'regs':>4} {'spill st/ld':>11} {'smem':>6}  {'dtype':<8} {'batch':<10} constexprs"
    )
    for variant, result in zip(_VARIANTS, results, strict=True):
        head = f"{variant.kernel:<19}"
        tail = f"{variant.dtype:<8} {variant.batch:<10} {variant.constexprs}"
        if isinstance(result, str):
            failures += 1
            print(f"{head} FAILED  {tail}\n    {result}")
            continue
        spilled = max(result.spill_stores, result.spill_loads)
        over = spilled > MAX_SPILL_BYTES.get(variant.kernel, 0)
        failures += over
        spills = f"{result.spill_stores}/{result.spill_loads}"
        print(
            f"{head} {result.registers:>4} {spills:>11} {result.shared:>6}  {tail}"
            + ("  <- SPILLS" if over else "")
        )
    print(f"{len(_VARIANTS)} variants, {failures} failed")
    return failures


def _ptxas() -> Path | None:
    spec = importlib.util.find_spec("triton")
    base = Path(spec.origin).parent if spec else TRITON_DIR / "triton"
    path = base / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.is_file() else None


def test_every_kernel_variant_compiles_for_sm90_within_its_spill_limit() -> None:
    if not triton_findable():
        pytest.skip(NO_TRITON)
    env = env_with_triton()
    env.pop("TRITON_INTERPRET", None)
    if _ptxas() is None:
        pytest.skip("the triton wheel here ships no ptxas (backends/nvidia/bin/ptxas)")
    with tempfile.TemporaryDirectory() as cache:
        # A fresh cache: a cached kernel would skip ptxas and its report.
        env.update(
            TRITON_CACHE_DIR=cache,
            TRITON_ALWAYS_COMPILE="1",
            TRITON_DUMP_PTXAS_LOG="1",
            TRITON_DEFAULT_FP_FUSION="1",  # the default before 3.9, said so to silence 3.9
        )
        cmd = [sys.executable, "-m", "tests.attention.test_triton_compile"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


if __name__ == "__main__":
    sys.exit(1 if compile_all() else 0)
