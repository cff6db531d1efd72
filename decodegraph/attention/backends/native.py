"""The CPU decode-attention operator, built from C/C++ on first use.

No library ships a paged decode attention for CPU that we could depend on, and at
batch 1 a dozen small tensor ops per layer (or a Python-level op) cost more than the
attention itself, so `decodegraph_cpu::paged_decode` does a layer's decode attention
in one C++ operator (csrc/paged_decode_op.cpp around the C kernel in
csrc/paged_decode.c). It is compiled once per machine with torch's extension builder
into a cache keyed by the sources, flags and CPU (~25 s the first time). Where it
cannot be built, `load_decode_op()` returns None and the backend keeps its tensor-op
path (also used for float16/bfloat16 and mixed batches).
Set DECODEGRAPH_NATIVE_KERNELS=0 to disable it. At block size 16 on a CPU with
AVX-512 it runs an intrinsics path, else portable loops; DECODEGRAPH_CPU_NO_AVX512=1
forces the portable loops (the tests use it to check both).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = (_CSRC / "paged_decode_op.cpp", _CSRC / "paged_decode.c")
# -ffast-math for the compile step only (vectorised expf, reassociated sums): linking
# with it would pull in crtfastmath.o, which sets flush-to-zero for the whole process.
_FLAG_SETS = (["-O3", "-march=native", "-ffast-math"], ["-O3", "-ffast-math"])


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((ln for ln in text.splitlines() if ln.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "decodegraph" / "kernels"


def _register_fake() -> None:
    @torch.library.register_fake("decodegraph_cpu::paged_decode")
    def _(query, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
          num_reqs, scale, workspace):  # noqa: ANN001, ANN202
        return query.new_empty(query.shape)


@cache
def load_decode_op() -> torch._ops.OpOverload | None:
    """`torch.ops.decodegraph_cpu.paged_decode.default`, or None where it cannot be built."""
    if os.environ.get("DECODEGRAPH_NATIVE_KERNELS", "1") == "0":
        return None
    from torch.utils.cpp_extension import load

    source = b"".join(p.read_bytes() for p in _SOURCES)
    for flags in _FLAG_SETS:
        salt = " ".join(flags) + "|" + _cpu_id() + "|" + torch.__version__
        key = hashlib.sha256(source + salt.encode()).hexdigest()[:16]
        build_dir = _cache_dir() / f"paged_decode_{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            load(
                name=f"decodegraph_paged_decode_{key}",
                sources=[str(_SOURCES[0])],
                extra_cflags=flags,
                extra_include_paths=[str(_CSRC)],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        except Exception as e:  # noqa: BLE001 - any build failure means: fall back
            logger.debug("decode operator build failed with %s: %s", flags, e)
            continue
        _register_fake()
        return torch.ops.decodegraph_cpu.paged_decode.default
    logger.warning(
        "The CPU decode-attention operator could not be built (no C++ compiler or torch "
        "headers?); using tensor ops, slower at small batch"
    )
    return None
