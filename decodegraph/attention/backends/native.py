"""The CPU decode-attention kernel in C, built on first use and loaded with ctypes.

No library ships a paged decode attention for CPU that we could depend on, and a
dozen small tensor ops per layer cost more than the attention itself at batch 1, so
one C function does a layer's decode attention. It is compiled with the system C
compiler into a per-user cache (keyed by source, flags and CPU), once. Where no
compiler works, `load_paged_decode()` returns None and the backend keeps its
tensor-op path (also used for float16/bfloat16 and mixed batches).
Set DECODEGRAPH_NATIVE_KERNELS=0 to disable it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -ffast-math at compile time only (vectorised expf, reassociated sums); linking with it
# would pull in crtfastmath.o, which sets flush-to-zero for the whole user process.
_FLAG_SETS = (
    ["-O3", "-march=native", "-ffast-math", "-fPIC"],
    ["-O3", "-ffast-math", "-fPIC"],
)
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P] * 6 + [_P, _P, _I, _P] + [_I] * 9 + [ctypes.c_float, _P, _I, _I, _I]


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next(
            (ln for ln in text.splitlines() if ln.startswith("flags")), platform.processor()
        )
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "decodegraph" / "kernels"


def _build(flags: list[str], target: Path) -> bool:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp) / "kernel.o", Path(tmp) / target.name
        for cmd in (
            [compiler, *flags, "-c", "-o", str(obj), str(_SOURCE)],
            [compiler, "-shared", "-o", str(out), str(obj), "-lm"],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                logger.debug("kernel build failed: %s: %s", cmd, proc.stderr)
                return False
        os.replace(out, target)  # atomic: concurrent builders never see half a file
    return True


@cache
def load_paged_decode() -> ctypes._CFuncPtr | None:
    """The compiled `paged_decode_f32`, or None when it cannot be built here."""
    if os.environ.get("DECODEGRAPH_NATIVE_KERNELS", "1") == "0":
        return None
    source = _SOURCE.read_bytes()
    for flags in _FLAG_SETS:
        salt = " ".join(flags) + "|link-separately|" + _cpu_id()
        key = hashlib.sha256(source + salt.encode()).hexdigest()
        target = _cache_dir() / f"paged_decode_{key[:16]}.so"
        try:
            if not target.exists() and not _build(flags, target):
                continue
            fn = ctypes.CDLL(str(target)).paged_decode_f32
        except OSError as e:
            logger.debug("kernel load failed: %s", e)
            continue
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int
        return fn
    logger.warning(
        "No C compiler could build the CPU decode-attention kernel; using tensor ops "
        "(slower at small batch)"
    )
    return None
