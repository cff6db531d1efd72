"""decodegraph's CPU operators, built from C/C++ on first use (vLLM's csrc, for CPU).

- `decodegraph_cpu::paged_attention`: a layer's attention for any batch (decodes,
  prefills, chunks) in one operator (the kernel in csrc/paged_attention.h). No library
  ships a paged attention for CPU that we could depend on; at batch 1 a dozen small
  tensor ops per layer (or a Python-level op) cost more than the attention itself, and
  a prefill of 256 short prompts paid one attention call per request and layer.
- `decodegraph_cpu::rms_norm` and `fused_add_rms_norm` (vLLM's names): RMSNorm in one
  pass per row (csrc/rms_norm.h); torch's CPU rms_norm is five to seven ops, two of them
  copies, a large share of an eager step at batch 256 (docs/performance.md).
- `decodegraph_cpu::rotary_embedding` (csrc/rotary_embedding.h, bit for bit the
  tensor-op formula) and `silu_and_mul` (vLLM's name, csrc/activation.h): one pass each
  instead of five and three ops per layer.
- `decodegraph_cpu::argmax_rows` (csrc/argmax.h): greedy sampling's first maximum per
  row, vectorised (torch's CPU `max(dim)` reduces a row a value at a time).
- `decodegraph_cpu::linear_one_row` (csrc/linear.h): one row times a float32 or bfloat16
  weight (bf16 summed in float32), its output rows split over the intra-op threads:
  BLAS's one-row product reads the weights on one thread (layers/linear.py uses it at
  batch 1). `linear_few_rows` (the same file): two to eight float32 rows, reading the
  weight once for all of them, where BLAS repacks it on every call at so few rows
  (layers/linear.py uses it for small decode batches).
- `decodegraph_cpu::shm_all_reduce` and `shm_all_gather` (csrc/shm_all_reduce.h): the
  tensor-parallel collectives between the ranks of one host through shared memory, set
  up by decodegraph/distributed/shm_all_reduce.py; a gloo all-reduce over loopback costs
  more than a decode step's matmuls.

csrc/cpu_ops.cpp registers them. Each kernel is written once against torch's
at::vec::Vectorized<float> (csrc/vec.h): the build picks the vector ISA of the machine,
-march=native with the at::vec capability macro that matches it (AVX-512 or AVX2 on x86,
NEON on aarch64, plain loops elsewhere). DECODEGRAPH_CPU_ISA=avx2 or =scalar forces a
narrower build (`available_isas()` lists what this machine can run; the tests check each
one). They are compiled once per machine and ISA with torch's extension builder into a
cache keyed by the sources, flags and CPU (seconds, the first time). Where they cannot be
built, `load_cpu_ops()` returns None and callers keep their tensor-op paths; one warning
per process says why (the build's last error) and names DECODEGRAPH_NATIVE_KERNELS=0,
which disables them without a build or a log. A large step splits its requests over
torch's intra-op threads.

A compiled graph's C++ wrapper calls the operators that stay opaque (the attention, the
projections, the collectives, the norms and activations on wide rows) through their C
shims (`c_shims()`, csrc/cpu_ops.cpp), a plain C call, instead of through the
dispatcher. The wrapper's library finds them in a forwarding library of a few lines,
loaded RTLD_GLOBAL, that depends on nothing but libc: the operators' library itself
stays RTLD_LOCAL, since making it global would put torch's libraries, their BLAS with
them, in the global scope, where any library loaded later (a CTranslate2 with an MKL of
its own, say) would bind to them.

Graph traces see the pointwise and norm operators on narrow rows as the aten ops they
stand for (`decompositions()`), so Inductor fuses them with their neighbours; on wide
rows, as always for the attention and the projections, a graph calls the operator.
Layers call them through `cpu_ops_for(x)`: float32 on CPU only (the attention and the
projections take bfloat16 too).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Beside this file in a checkout and in an installed wheel alike (site-packages/
# decodegraph/native/csrc: pyproject.toml's package-data ships every file of it).
_CSRC = Path(__file__).with_name("csrc")


def _sources() -> tuple[Path, ...]:
    """cpu_ops.cpp, then every other file of csrc/: cpu_ops.cpp includes them all, and all
    of them key the build cache. Listed on first use, so that an install without csrc/
    still imports (and `load_cpu_ops()` says what is missing)."""
    return (
        _CSRC / "cpu_ops.cpp",
        *sorted(p for p in _CSRC.iterdir() if p.suffix in (".c", ".h")),
    )


# -ffast-math for the compile step only (reassociated sums): linking with it would pull in
# crtfastmath.o, which sets flush-to-zero for the whole process. -ffp-contract=off: no
# multiply-add is fused unless a kernel asks for one (rotary_embedding is bit for bit the
# tensor formula). -fopenmp: at::parallel_for is OpenMP in torch's headers; the library
# links against libgomp.so.1, the one torch has already loaded. Without it (no OpenMP in
# the compiler) the operators build and run on one thread. -falign-loops/-functions=64:
# every loop and function starts on a cache line, so that an edit elsewhere in the library
# does not move a kernel's hot loop across the core's fetch boundaries, which slowed an
# unchanged loop measurably (docs/performance.md, 2026-12-07, "kernels aligned").
_BASE_FLAGS = [
    "-O3",
    "-ffast-math",
    "-ffp-contract=off",
    "-falign-loops=64",
    "-falign-functions=64",
]

# Per vector ISA: the target and the at::vec capability macro to match. at::vec picks
# AVX-512 or AVX2 only when CPU_CAPABILITY_AVX512 or _AVX2 is defined (its headers
# otherwise compile the plain-loop DEFAULT version, whatever -march says); on aarch64 it
# is NEON without a macro. CPU_CAPABILITY names at::vec's inline namespace: our own name,
# so that no symbol of ours resolves to libtorch's copies or the other way round.
_ISA_FLAGS = {
    "avx512": ["-march=native", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=dg_avx512"],
    "avx2": [
        "-march=native",
        "-mno-avx512f",  # and with it every AVX-512 subset: what an AVX2-only CPU builds
        "-DCPU_CAPABILITY_AVX2",
        "-DCPU_CAPABILITY=dg_avx2",
    ],
    "neon": ["-march=native", "-DCPU_CAPABILITY=dg_neon"],
    # The portable loops, for the baseline of the architecture (no -march).
    "scalar": ["-DCPU_CAPABILITY=dg_default"],
}


def available_isas() -> list[str]:
    """The vector ISAs this machine runs, best first (torch's own CPU detection, which
    ATEN_CPU_CAPABILITY may narrow): what `DECODEGRAPH_CPU_ISA` may name."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return ["neon"]  # at::vec has no non-NEON build on aarch64
    capability = torch.backends.cpu.get_cpu_capability()
    isas = {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(capability, [])
    return [*isas, "scalar"]


def _isa() -> str:
    """The ISA to build: DECODEGRAPH_CPU_ISA where this machine runs it, else the best."""
    isas = available_isas()
    wanted = os.environ.get("DECODEGRAPH_CPU_ISA", "").strip().lower()
    if not wanted and os.environ.get("DECODEGRAPH_CPU_NO_AVX512") == "1":  # the old switch
        wanted = next(i for i in isas if i != "avx512")
    if wanted and wanted not in isas:
        logger.warning(
            "DECODEGRAPH_CPU_ISA=%s is not one this machine runs (%s); building for %s",
            wanted,
            ", ".join(isas),
            isas[0],
        )
        wanted = ""
    return wanted or isas[0]


def _flag_sets(isa: str) -> list[list[str]]:
    """Flag sets to try in turn: the ISA's with OpenMP, without, then the portable one."""
    flags = _BASE_FLAGS + _ISA_FLAGS[isa]
    return [flags + ["-fopenmp"], flags, _BASE_FLAGS + _ISA_FLAGS["scalar"]]


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


@cache
def _register_fakes() -> None:
    """Once per process: a later load (tests clear load_cpu_ops' cache) must not register
    them again, which torch 2.10 refuses."""

    @torch.library.register_fake("decodegraph_cpu::paged_attention")
    def _(query, *_):  # noqa: ANN001, ANN202
        return query.new_empty(query.shape)

    @torch.library.register_fake("decodegraph_cpu::paged_attention_windowed_capped")
    def _(query, *_):  # noqa: ANN001, ANN202
        return query.new_empty(query.shape)

    @torch.library.register_fake("decodegraph_cpu::paged_attention_out")
    def _(*_):  # noqa: ANN202
        return None

    @torch.library.register_fake("decodegraph_cpu::rms_norm")
    def _(x, weight, eps):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape)

    @torch.library.register_fake("decodegraph_cpu::fused_add_rms_norm")
    def _(x, residual, weight, eps):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("decodegraph_cpu::rotary_embedding")
    def _(x, cos, sin):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape)

    @torch.library.register_fake("decodegraph_cpu::silu_and_mul")
    def _(x):  # noqa: ANN001, ANN202
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.register_fake("decodegraph_cpu::argmax_rows")
    def _(x):  # noqa: ANN001, ANN202
        return x.new_empty((x.shape[0],), dtype=torch.long)

    @torch.library.register_fake("decodegraph_cpu::linear_one_row")
    def _(x, weight, bias):  # noqa: ANN001, ANN202
        return x.new_empty((1, weight.shape[0]))

    @torch.library.register_fake("decodegraph_cpu::linear_few_rows")
    def _(x, weight, bias):  # noqa: ANN001, ANN202
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("decodegraph_cpu::shm_all_reduce")
    def _(x, handle):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape)

    @torch.library.register_fake("decodegraph_cpu::shm_all_gather")
    def _(x, handle, world_size):  # noqa: ANN001, ANN202
        return x.new_empty((x.shape[0] * world_size, *x.shape[1:]))


def _ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH. The ninja dependency puts it in
    the environment's bin/, which is not on PATH when that environment's python runs
    without being activated: append that directory then (and only then)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja

        bin_dir = str(ninja.BIN_DIR)
    except Exception:  # noqa: BLE001 - no ninja package: torch's error will say so
        return
    path = os.environ.get("PATH")
    os.environ["PATH"] = f"{path}{os.pathsep}{bin_dir}" if path else bin_dir


# A compiler's or shell's diagnostic line in a failed build's output.
_DIAGNOSTIC = re.compile(r"error:|not found|no such file", re.IGNORECASE)


def _reason(e: BaseException) -> str:
    """A failed build's reason in one line: the exception's first line and, for a failed
    compile, its first diagnostic ("fatal error: vec.h: No such file or directory",
    "/bin/sh: 1: c++: not found") instead of the ninja command line that follows."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    head = lines[0] if isinstance(e, RuntimeError) else f"{type(e).__name__}: {lines[0]}"
    if head.startswith("Error building extension"):
        head = head.split(": ", 1)[0]  # what follows is ninja's "[1/2] c++ ..." command
    detail = next((ln for ln in lines[1:] if _DIAGNOSTIC.search(ln)), None)
    text = f"{head}: {detail}" if detail else head
    return text if len(text) <= 300 else text[:297] + "..."


def _build_key(sources: Sequence[Path], flags: Sequence[str]) -> str:
    """The build cache's key: the sources' bytes, the flags, the CPU and torch, and where
    the sources and torch's headers are. torch's builder rebuilds a library whose build
    command changed, so two checkouts or environments that shared a directory would
    rebuild it in turn (and one could load the other's half-written library)."""
    source = b"".join(p.read_bytes() for p in sources)
    where = f"{_CSRC.resolve()}|{Path(torch.__file__).resolve().parent}"
    salt = " ".join(flags) + "|" + _cpu_id() + "|" + torch.__version__ + "|" + where
    return hashlib.sha256(source + salt.encode()).hexdigest()[:16]


@cache
def load_cpu_ops() -> object | None:
    """`torch.ops.decodegraph_cpu` with its operators loaded, or None where they cannot
    be built (then one warning, with the reason, per process: this is cached)."""
    if os.environ.get("DECODEGRAPH_NATIVE_KERNELS", "1") == "0":
        return None
    _ninja_on_path()
    reason = "no flag set tried"
    for flags in _flag_sets(_isa()):
        try:
            from torch.utils.cpp_extension import load

            sources = _sources()
            key = _build_key(sources, flags)
            build_dir = _cache_dir() / f"cpu_ops_{key}"
            build_dir.mkdir(parents=True, exist_ok=True)
            load(
                name=f"decodegraph_cpu_ops_{key}",
                sources=[str(sources[0])],
                extra_cflags=flags,
                extra_ldflags=[f for f in flags if f == "-fopenmp"],
                extra_include_paths=[str(_CSRC)],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        except Exception as e:  # noqa: BLE001 - any build failure means: fall back
            logger.debug("CPU operator build failed with %s: %s", flags, e)
            reason = _reason(e)
            continue
        _make_shims_visible(build_dir / f"decodegraph_cpu_ops_{key}.so")
        _register_fakes()
        return torch.ops.decodegraph_cpu
    logger.warning(
        "decodegraph's CPU operators could not be built (%s); using tensor ops, slower at "
        "small batch. Set DECODEGRAPH_NATIVE_KERNELS=0 to skip the build and this warning.",
        reason,
    )
    return None


# Free CPU blocks the caching allocator keeps by default (csrc/cpu_allocator.h).
_ALLOCATOR_CACHE_MB = 64


# Whether the loaded library's C shims are visible to other libraries (c_shims()).
_shims_visible = False


def _make_shims_visible(library: Path) -> None:
    """Build (once) and load, RTLD_GLOBAL, the forwarding library (`_forwarder_source()`)
    and point each of its shims at the operators' library's `decodegraph_shim_<op>`. The
    operators' library, loaded by torch.ops.load_library, is only looked up (RTLD_NOLOAD,
    local). Where any of it fails, graphs call the operators through the dispatcher
    (c_shims() gives none)."""
    global _shims_visible
    try:
        ops = ctypes.CDLL(str(library), mode=os.RTLD_NOLOAD)
        forwarder = ctypes.CDLL(str(_build_forwarder(library.parent)), mode=os.RTLD_GLOBAL)
        for name in C_SHIMS:
            target = ctypes.cast(getattr(ops, f"decodegraph_shim_{name}"), ctypes.c_void_p)
            ctypes.c_void_p.in_dll(forwarder, f"decodegraph_target_{name}").value = target.value
    except (OSError, AttributeError, ValueError, subprocess.SubprocessError) as e:
        # OSError: not loaded, no compiler; AttributeError: no such flag (not POSIX)
        logger.debug("the CPU operators' C shims stay local (%s): dispatcher calls", e)
        return
    _shims_visible = True


def _forwarder_source() -> str:
    """The C source of the forwarding library: for each C_SHIMS entry, a pointer
    `decodegraph_target_<op>` and the shim `aoti_torch_cpu_<op>`, which calls it. The
    handle and error types are declared as torch's shim.h declares them (a pointer to an
    opaque struct, an int32), so the library needs no header and links nothing."""
    parts = [
        "#include <stdint.h>\n"
        "typedef struct AtenTensorOpaque* AtenTensorHandle;\n"
        "typedef int32_t AOTITorchError;\n"
    ]
    for name, declaration in C_SHIMS.items():
        params = declaration[declaration.index("(") + 1 : declaration.rindex(")")]
        args = ", ".join(re.split(r"[\s*]+", p.strip())[-1] for p in params.split(","))
        parts.append(
            f"AOTITorchError (*decodegraph_target_{name})({params}) = 0;\n"
            f"{declaration} {{ return decodegraph_target_{name}({args}); }}\n"
        )
    return "".join(parts)


def _build_forwarder(build_dir: Path) -> Path:
    """The forwarding library, compiled into build_dir on first use (the file named by its
    source's hash; written under a temporary name, then renamed, so that processes
    building it at once do not read each other's half-written file)."""
    source = _forwarder_source()
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    library = build_dir / f"graph_shims_{key}.so"
    if library.exists():
        return library
    from torch.utils.cpp_extension import get_cxx_compiler

    c_file = build_dir / f"graph_shims_{key}.c"
    c_file.write_text(source)
    partial = build_dir / f"graph_shims_{key}.{os.getpid()}.so"
    # -x c: the source is C; --as-needed: no libstdc++ or libm the C++ driver adds
    command = [get_cxx_compiler(), "-x", "c", "-O2", "-fPIC", "-shared", "-Wl,--as-needed"]
    subprocess.run([*command, str(c_file), "-o", str(partial)], check=True, capture_output=True)
    os.replace(partial, library)
    return library


# Each opaque operator's C shim, as Inductor declares it in a C++ wrapper: csrc/
# cpu_ops.cpp defines them (the signatures must match). A shim's name is the one Inductor
# gives an operator's CPU shim; a `Tensor?` is a nullable AtenTensorHandle*.
_H = "AtenTensorHandle"
C_SHIMS = {
    "paged_attention": (
        f"AOTITorchError aoti_torch_cpu_paged_attention({_H} query, {_H} key, {_H} value, "
        f"{_H} k_cache, {_H} v_cache, {_H} slot_mapping, {_H} block_tables, "
        f"{_H} query_start_loc, {_H} seq_lens, {_H} num_reqs, double scale, "
        f"{_H} workspace, {_H}* ret0)"
    ),
    "paged_attention_windowed_capped": (
        f"AOTITorchError aoti_torch_cpu_paged_attention_windowed_capped({_H} query, "
        f"{_H} key, {_H} value, {_H} k_cache, {_H} v_cache, {_H} slot_mapping, "
        f"{_H} block_tables, {_H} query_start_loc, {_H} seq_lens, {_H} num_reqs, "
        f"double scale, {_H} workspace, int64_t sliding_window, double logits_soft_cap, "
        f"{_H}* ret0)"
    ),
    "rms_norm": (
        f"AOTITorchError aoti_torch_cpu_rms_norm({_H} x, {_H} weight, double eps, {_H}* ret0)"
    ),
    "fused_add_rms_norm": (
        f"AOTITorchError aoti_torch_cpu_fused_add_rms_norm({_H} x, {_H} residual, "
        f"{_H} weight, double eps, {_H}* ret0, {_H}* ret1)"
    ),
    "rotary_embedding": (
        f"AOTITorchError aoti_torch_cpu_rotary_embedding({_H} x, {_H} cos, {_H} sin, {_H}* ret0)"
    ),
    "silu_and_mul": f"AOTITorchError aoti_torch_cpu_silu_and_mul({_H} x, {_H}* ret0)",
    "linear_one_row": (
        f"AOTITorchError aoti_torch_cpu_linear_one_row({_H} x, {_H} weight, {_H}* bias, {_H}* ret0)"
    ),
    "linear_few_rows": (
        f"AOTITorchError aoti_torch_cpu_linear_few_rows({_H} x, {_H} weight, {_H}* bias, "
        f"{_H}* ret0)"
    ),
    "shm_all_reduce": (
        f"AOTITorchError aoti_torch_cpu_shm_all_reduce({_H} x, int64_t handle, {_H}* ret0)"
    ),
    "shm_all_gather": (
        f"AOTITorchError aoti_torch_cpu_shm_all_gather({_H} x, int64_t handle, "
        f"int64_t world_size, {_H}* ret0)"
    ),
}


def c_shims() -> dict:
    """For Inductor's aot_inductor.custom_ops_to_c_shims: each loaded opaque operator ->
    its C shim's declaration ({} where the operators are not loaded)."""
    ops = load_cpu_ops()
    if ops is None or not _shims_visible:
        return {}
    return {getattr(ops, name).default: [decl] for name, decl in C_SHIMS.items()}


@cache
def graph_cache_hashes_operators() -> bool:
    """Whether Inductor's FX graph cache can make a key of options that hold the shims'
    mapping (keyed by operator; an operator does not pickle). torch 2.13's key maker
    says it cannot (BypassFxGraphCache) and the graph compiles without that cache;
    torch 2.10's raised an error that failed every compile. Where this is False the CPU
    platform turns that cache off for its graphs (CpuPlatform.inductor_options), as
    2.13 bypasses it: our compiled-graph index is what keeps graphs across processes."""
    try:
        from torch._inductor.codecache import BypassFxGraphCache, FxGraphCachePickler

        empty = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        FxGraphCachePickler(empty).dumps({torch.ops.aten.add.Tensor: ["shim"]})
    except BypassFxGraphCache:
        return True
    except Exception as e:  # noqa: BLE001 - any other failure: no FX graph cache
        logger.debug("Inductor's FX graph cache cannot hash operators (%s): off", e)
        return False
    return True


def install_cpu_allocator() -> bool:
    """Put the operators' caching allocator in front of c10's CPU allocator, for this
    process: tensors up to 4 MiB are served from free lists of their size class instead
    of glibc's posix_memalign, which takes the arena lock on every call (a replayed
    graph allocates each intermediate buffer afresh). It keeps at most
    DECODEGRAPH_CPU_ALLOCATOR_CACHE_MB of free blocks (default 64; 0: not installed).
    Returns whether it is installed; False where the operators are not loaded."""
    raw = os.environ.get("DECODEGRAPH_CPU_ALLOCATOR_CACHE_MB", str(_ALLOCATOR_CACHE_MB))
    try:
        mb = int(raw)
        if mb < 0:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"DECODEGRAPH_CPU_ALLOCATOR_CACHE_MB must be a whole number of MiB, 0 or more; "
            f"got {raw!r}"
        ) from None
    ops = load_cpu_ops()
    if ops is None or not hasattr(ops, "cpu_allocator_install"):
        return False
    ops.cpu_allocator_install(mb << 20)
    return mb > 0


def cpu_isa() -> str | None:
    """The vector ISA the loaded operators were built for (avx512, avx2, neon or scalar),
    or None where they are not loaded."""
    ops = load_cpu_ops()
    return None if ops is None else ops.vector_isa()


def cpu_ops_for(x: torch.Tensor) -> object | None:
    """The CPU operators where they apply to `x` (float32 on CPU), else None."""
    if not x.is_cpu or x.dtype != torch.float32:
        return None
    return load_cpu_ops()


# Values per token below which a graph sees a pointwise or norm operator as the aten
# ops it stands for (decompositions()). On narrower rows the operator's own call costs
# more than its work, and Inductor fuses the aten ops with their neighbours instead; on
# wider rows its call is a small part of a step dominated by the projections' weight
# streams, and keeping the operator saves Inductor generating and compiling a kernel for
# it in every layer of every graph (docs/performance.md, 2026-12-04 20:18).
FUSE_IN_GRAPHS_BELOW = 512


def decompositions() -> dict:
    """For graph traces: each loaded pointwise or norm operator -> the aten ops it stands
    for, where its rows hold fewer than FUSE_IN_GRAPHS_BELOW values per token (a
    compiler fuses these with their neighbours); on wider rows the trace keeps the
    operator, which a compiled graph calls through its C shim. The attention, the
    projections and the collectives are not among them: they stay opaque."""
    if not hasattr(torch.ops, "decodegraph_cpu") or not hasattr(
        torch.ops.decodegraph_cpu, "rms_norm"
    ):
        return {}
    import torch.nn.functional as F

    def narrow(x: torch.Tensor) -> bool:
        return math.prod(x.shape[1:]) < FUSE_IN_GRAPHS_BELOW

    # Each returns NotImplemented (make_fx then records the operator itself) for wide rows.
    def rms_norm(x, weight, eps):  # noqa: ANN001, ANN202
        if not narrow(x):
            return NotImplemented
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def fused_add_rms_norm(x, residual, weight, eps):  # noqa: ANN001, ANN202
        if not narrow(x):
            return NotImplemented
        res = x + residual
        return F.rms_norm(res, (res.shape[-1],), weight, eps), res

    def rotary_embedding(x, cos, sin):  # noqa: ANN001, ANN202
        if not narrow(x):
            return NotImplemented
        return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin

    def silu_and_mul(x):  # noqa: ANN001, ANN202
        if not narrow(x):
            return NotImplemented
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    ops = torch.ops.decodegraph_cpu
    return {
        ops.rms_norm.default: rms_norm,
        ops.fused_add_rms_norm.default: fused_add_rms_norm,
        ops.rotary_embedding.default: rotary_embedding,
        ops.silu_and_mul.default: silu_and_mul,
    }
