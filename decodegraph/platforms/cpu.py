"""CPU: graphs are traced op graphs (make_fx), optionally compiled by Inductor."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from decodegraph import native
from decodegraph.platforms.base import DeviceGraph, GraphFn, Platform
from decodegraph.platforms.cpu_graph import (
    CpuGraph,
    DynamicRowsCpuGraph,
    compile_with_inductor,
    index_only,
    start_vector_isa_probe,
    warm_process_wide_traces,
)

if TYPE_CHECKING:
    from decodegraph.config import CompilationConfig

# Without an explicit budget, the KV cache takes this share of available host memory.
_CPU_KV_CACHE_SHARE = 0.25
_CPU_KV_CACHE_MAX_BYTES = 4 << 30
# Tokens of the start-up profiling forward (see CpuPlatform.profile_num_tokens).
_CPU_PROFILE_TOKENS = 16


def _inductor_isa_probe_redundant() -> bool:
    """Whether Inductor's vector-ISA probe can only confirm what this process knows.

    Before its first CPU graph, Inductor compiles and loads a test library for each vector
    ISA the CPU reports (a compiler run and a child Python each, in every process). Our
    operators were built by the same compiler for this machine's widest ISA, over the same
    ATen vector headers (decodegraph/native), so for AVX-512, AVX2 and NEON the probe
    cannot fail where that build did not. `cpp.vec_isa_ok` skips only that check of the
    headers: Inductor still compiles and loads its own test of each extension beside
    (AVX-512 BF16, VNNI, AMX), so an AMX CPU keeps its AMX check. SVE, whose base check
    is the headers' under other flags, and a build narrowed by DECODEGRAPH_CPU_ISA keep
    the probe, as does `inductor_compile_config={"cpp.vec_isa_ok": None}`.
    """
    isa = native.cpu_isa()
    if isa == "avx512":
        return True
    if isa == "avx2":
        return not torch.cpu._is_avx512_supported()
    if isa == "neon":
        # A torch without get_capabilities (2.10 has none) cannot tell SVE
        # apart here: the probe stays.
        get_capabilities = getattr(torch.cpu, "get_capabilities", None)
        if get_capabilities is None:
            return False
        caps = get_capabilities()
        return not (caps.get("sve") or caps.get("sve2"))
    return False


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    supports_graphs: ClassVar[bool] = True
    supports_dynamic_graphs: ClassVar[bool] = True
    supports_background_graphs: ClassVar[bool] = True
    supports_forked_builds: ClassVar[bool] = True
    default_attention_backend: ClassVar[str | None] = "CPU_TORCH"
    # Each CPU graph is compiled by Inductor (seconds per size, plus a one-time set-up
    # in a process with a cold cache), so few sizes keep a cold start short. No 2: a
    # batch of 2 padded to the 4-row graph costs a little over its own graph, and
    # nothing where a step is bound by reading the weights (README, docs/performance.md).
    default_capture_sizes: ClassVar[list[int]] = [1, 4, 8]
    # vLLM's CPU defaults for chunked prefill.
    default_max_num_batched_tokens: ClassVar[dict[str, int]] = {
        "LLM_CLASS": 4096,
        "OPENAI_API_SERVER": 2048,
    }
    # Inductor options for CPU graphs; compilation_config.inductor_compile_config wins.
    # The C++ wrapper calls kernels without a Python frame each. Inductor's
    # decompose_mm_pass turns one-row matmuls (the batch-1 graph's projections) into its
    # own fused C++ loops instead of a BLAS call each. Inductor's C++ GEMM templates
    # (freezing + max_autotune) are left to inductor_compile_config: frozen graphs are
    # not cached, so they multiply start-up. No size, stride, alignment or scalar asserts
    # on every call: a graph is replayed with the very tensors it was captured with, and
    # the graph runner checks their addresses on its first replay. The wrapper (one long
    # function of a few hundred calls into ATen and the kernels, unrolled over the
    # layers) is built apart from the kernels and at -O1, the kernels at -O3 as before:
    # -O3 over the wrapper was most of a cold compile and bought no replay time.
    # docs/performance.md has what each option measured.
    default_inductor_options: ClassVar[dict[str, object]] = {
        "cpp_wrapper": True,
        "cpp_wrapper_build_separate": True,
        "post_grad_fusion_options": {"decompose_mm_pass": {}},
        "size_asserts": False,
        "alignment_asserts": False,
        "scalar_asserts": False,
    }

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: torch.dtype) -> tuple[torch.dtype, str]:
        """bf16 checkpoints stay bf16, with or without native bf16 instructions: a decode
        step is bandwidth-bound and bf16 weights are half the bytes, which outweighs the
        conversions on AVX2 and AVX-512 alike (docs/performance.md, "bf16 on the CPU")."""
        if checkpoint_dtype == torch.bfloat16:
            return checkpoint_dtype, "bf16 weights halve the bytes a decode step reads"
        return checkpoint_dtype, "the checkpoint's dtype"

    def configure_process(self) -> None:
        """Intra-op threads: DECODEGRAPH_CPU_THREADS, else all cores but one; and the
        native operators' caching allocator for CPU tensors (native.install_cpu_allocator).

        A decode step is hundreds of tiny ops; an OpenMP team whose other thread is
        descheduled (the core busy with the API server, tokenizer or another process)
        turns each op's barrier into a scheduler time slice, so one core is left free
        (docs/performance.md, "threads").
        """
        threads = os.environ.get("DECODEGRAPH_CPU_THREADS")
        n = int(threads) if threads else max(1, (os.cpu_count() or 2) - 1)
        torch.set_num_threads(n)
        native.install_cpu_allocator()

    # ---------------------------------------------------------------- graphs

    def prepare_graph_compile(self, config: CompilationConfig) -> None:
        """Inductor's choice of vector ISA (a compiler run and a child Python per ISA
        feature it checks, in every process) runs in a thread while the model loads."""
        if config.use_inductor:
            # Under the options the compiles will use: the process keeps its answer.
            vec_isa_ok = self.inductor_options(config).get("cpp.vec_isa_ok")
            start_vector_isa_probe(vec_isa_ok)

    def graph_decompositions(self) -> dict:
        return native.decompositions()

    def inductor_options(self, config: CompilationConfig) -> dict[str, object]:
        """The platform's Inductor options, with the user's on top. (A graph holding a
        gloo collective is compiled without the C++ wrapper: compile_with_inductor.)"""
        options = dict(self.default_inductor_options)
        # The wrapper calls the opaque operators as C functions, not through the
        # dispatcher (native.c_shims); a torch whose FX graph cache cannot key them
        # compiles without that cache (native.graph_cache_hashes_operators).
        shims = native.c_shims()
        options["aot_inductor.custom_ops_to_c_shims"] = shims
        if shims and not native.graph_cache_hashes_operators():
            options["fx_graph_cache"] = False
        if _inductor_isa_probe_redundant():
            options["cpp.vec_isa_ok"] = True
        return {**options, **config.inductor_compile_config}

    def make_graph(
        self,
        name: str,
        fn: GraphFn,
        inputs: Sequence[torch.Tensor],
        config: CompilationConfig,
        weak_outputs: bool = False,
        runs_later: bool = False,
    ) -> DeviceGraph:
        # A CPU graph's outputs are new tensors at every replay: nothing to share. Its
        # C++ builds in the background, while the graph runner compiles the next size.
        return CpuGraph(
            name,
            fn,
            inputs,
            config.use_inductor,
            self.inductor_options(config),
            self.graph_decompositions(),
            defer=True,
            runs_later=runs_later,
        )

    def make_dynamic_graph(
        self,
        name: str,
        fn: GraphFn,
        inputs: Sequence[torch.Tensor],
        fewest_rows: int,
        config: CompilationConfig,
        runs_later: bool = False,
    ) -> DeviceGraph:
        return DynamicRowsCpuGraph(
            name,
            fn,
            inputs,
            fewest_rows,
            config.use_inductor,
            self.inductor_options(config),
            self.graph_decompositions(),
            runs_later,
        )

    def cached_graphs_only(self) -> contextlib.AbstractContextManager[None]:
        return index_only()

    def before_background_graph(self) -> None:
        warm_process_wide_traces()

    def make_piece(
        self,
        name: str,
        piece: torch.fx.GraphModule,
        args: Sequence[torch.Tensor],
        stable: set[int],
        config: CompilationConfig,
    ) -> Callable[..., Any]:
        """The traced piece, Inductor-compiled or as it is. A CPU piece returns fresh
        outputs each call, so its arguments need no fixed addresses; its weights are
        the model's own tensors (lifted into trailing inputs, not copied)."""
        if not config.use_inductor:
            return piece
        return compile_with_inductor(piece, args, self.inductor_options(config))

    # ---------------------------------------------------------------- memory

    def profile_num_tokens(self, max_num_tokens: int) -> int:
        """A short forward: this platform measures no activation peak (its KV budget is a
        share of free host memory), so the profiling run is a smoke test and warm-up
        only, and the largest batch's eager forward would be start-up's longest phase on
        a mid-size model (tens of seconds for 2048 tokens)."""
        return min(max_num_tokens, _CPU_PROFILE_TOKENS)

    def allocate_kv_cache(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Zeroed by the kernel, not by us, and on huge pages where the kernel allows
        (transparent huge pages in "madvise" mode; their size is the kernel's,
        huge_page_size).

        The cache is an anonymous private mapping of its own: its pages read as zeros
        until first written (POSIX guarantees it), so the null block and the unwritten
        slots a padded row or a block's tail may be read through are zeros, and no
        start-up pass touches gigabytes to zero them (a 3 GB cache took seconds). A page
        is faulted in when decode first writes it, huge where the advice holds: decode
        reads blocks scattered over tens of MB, and with 4 KiB pages most block reads
        miss the TLB (docs/performance.md). The tensor starts on a huge-page boundary of
        a slightly larger mapping, so that its first blocks (the ones a fresh engine
        hands out first) are on huge pages too (_huge_page_bytes)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        cache = _huge_page_bytes(nbytes).view(dtype).view(shape)
        return cache.to(device)  # the CPU device: the same tensor

    def place_parameters(self, model: torch.nn.Module) -> None:
        """Every parameter that owns its memory moves, before loading, into one
        anonymous mapping on huge pages where the kernel allows (transparent huge pages
        in "madvise" mode), packed at 64-byte boundaries.

        A decode step streams every weight once; with 4 KiB pages the stream walks the
        page tables every 4 KiB, and on huge pages one thread reads the weights faster
        (docs/performance.md, "weights on huge pages"). Nothing is copied: parameters
        are uninitialised until loading writes them (get_model), so loading's first
        touches fault in huge pages directly. Tied parameters move once; a parameter
        that is a view of a larger tensor stays where it is.
        DECODEGRAPH_CPU_HUGE_PAGE_WEIGHTS=0 leaves every parameter where it is."""
        setting = os.environ.get("DECODEGRAPH_CPU_HUGE_PAGE_WEIGHTS", "1")
        if setting not in ("0", "1"):
            raise ValueError(f"DECODEGRAPH_CPU_HUGE_PAGE_WEIGHTS must be 0 or 1; got {setting!r}")
        if setting == "0":
            return
        params = [
            p
            for p in model.parameters()  # a tied parameter once
            if p.device.type == "cpu"
            and p.storage_offset() == 0
            and p.is_contiguous()
            and p.untyped_storage().nbytes() == p.nbytes
        ]
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.nbytes // _PARAMETER_ALIGNMENT) * _PARAMETER_ALIGNMENT
        if total == 0:
            return
        arena = _huge_page_bytes(total)
        for p, offset in zip(params, offsets, strict=True):
            p.data = arena[offset : offset + p.nbytes].view(p.dtype).view(p.shape)

    def tune_for_weights(self, model: torch.nn.Module) -> None:
        """The batch-1 projection's row order, timed both ways over the loaded
        weights where they outgrow the caches (platforms/cpu_projection.py)."""
        from decodegraph.platforms.cpu_projection import choose_projection_rows

        choose_projection_rows(model)

    def memory_allocated(self) -> int:
        """Resident memory of this process (what graph capture adds shows up here)."""
        try:
            resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return 0
        return resident_pages * os.sysconf("SC_PAGE_SIZE")

    def available_kv_cache_memory(
        self, gpu_memory_utilization: float, used_bytes: int, num_local_ranks: int = 1
    ) -> int:
        """A share of free host memory, split between the ranks of this host."""
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        total = min(int(pages * _CPU_KV_CACHE_SHARE), _CPU_KV_CACHE_MAX_BYTES)
        return total // num_local_ranks


_MADV_HUGEPAGE = 14
# The kernel's transparent huge page size: 2 MiB on x86-64 and on 4 KiB-page ARM
# kernels, 512 MiB on 64 KiB-page ARM kernels, 32 MiB on 16 KiB-page ones.
_PMD_SIZE_FILE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
_DEFAULT_HUGE_PAGE = 2 << 20
# Where place_parameters packs parameters: a cache line (and every dtype's alignment).
_PARAMETER_ALIGNMENT = 64


@functools.cache
def huge_page_size() -> int:
    """The size of this kernel's transparent huge pages (its PMD size), from sysfs; 2 MiB
    where the file is missing or unreadable."""
    try:
        size = int(_PMD_SIZE_FILE.read_text())
    except (OSError, ValueError):
        return _DEFAULT_HUGE_PAGE
    return size if size > 0 and size & (size - 1) == 0 else _DEFAULT_HUGE_PAGE


def _huge_page_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (uint8) of an anonymous private mapping of their own, advised
    onto transparent huge pages. Where they fill a huge page or more, they start on a
    huge-page boundary of a mapping one huge page larger (address space only: untouched
    pages take no memory), so that their first bytes can be on a huge page too.

    The pages read as zeros until first written (POSIX guarantees it) and are faulted in
    when first touched, huge where the advice holds. Every tensor viewing the bytes
    holds the mapping; it is unmapped with the last one's storage."""
    huge = huge_page_size()
    slack = huge if nbytes >= huge else 0
    mapping = mmap.mmap(-1, nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -raw.data_ptr() % huge if slack else 0
    data = raw[skip : skip + nbytes]
    _advise_huge_pages(data)
    return data


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    """madvise(MADV_HUGEPAGE) over the pages holding `tensor`'s memory, which must be
    all of its mapping's or the middle of one of ours (_huge_page_bytes). The kernel
    puts huge pages where a huge page's aligned range lies inside, and where it has
    smaller multi-size ones, those in the rest. A no-op where the call is unavailable or
    refused."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page) * page
    if end <= start or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
