"""CPU: graphs are traced op graphs (make_fx), optionally compiled by Inductor."""

from __future__ import annotations

import ctypes
import math
import os
import sys
from pathlib import Path
from typing import ClassVar

import torch

from decodegraph.attention.backends.base import AttentionBackend
from decodegraph.attention.selector import get_attn_backend
from decodegraph.platforms.base import Platform

# Without an explicit budget, the KV cache takes this share of available host memory.
_CPU_KV_CACHE_SHARE = 0.25
_CPU_KV_CACHE_MAX_BYTES = 4 << 30


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    graph_capture_kind: ClassVar[str | None] = "cpu"
    # Each CPU graph is compiled by Inductor (~4 s per size here, plus ~10 s of one-time
    # set-up in a process with a cold cache), so few sizes keep a cold start under 30 s.
    default_capture_sizes: ClassVar[list[int]] = [1, 2, 4, 8]
    # The C++ wrapper calls kernels without a Python frame each (~15 % off a stories260K
    # decode step). Inductor's decompose_mm_pass turns one-row matmuls (the batch-1
    # graph's projections) into its own fused C++ loops instead of a BLAS call each
    # (+13-29 % at batch 1 here, cached like any graph). Inductor's C++ GEMM templates
    # (freezing + max_autotune) gained 8 % at batch 1 but tripled start-up (frozen
    # graphs are not cached), so they are left to compilation_config.
    # inductor_compile_config (docs/performance.md). No size, stride, alignment or
    # scalar asserts on every call (~18 µs of a 184 µs batch-1 step for 55 inputs): a
    # graph is replayed with the very tensors it was captured with, whose addresses are
    # checked on its first replay (decodegraph/graphs/graph.py).
    default_inductor_options: ClassVar[dict[str, object]] = {
        "cpp_wrapper": True,
        "post_grad_fusion_options": {"decompose_mm_pass": {}},
        "size_asserts": False,
        "alignment_asserts": False,
        "scalar_asserts": False,
    }

    def configure_process(self) -> None:
        """Intra-op threads: DECODEGRAPH_CPU_THREADS, else all cores but one.

        A decode step is hundreds of tiny ops; an OpenMP team whose other thread is
        descheduled (the core busy with the API server, tokenizer or another process)
        turns each op's barrier into a scheduler time slice: measured here, 1 thread ran
        stories260K decode at ~1,050 tokens/s and 2 threads at 45-90 on a busy machine.
        """
        threads = os.environ.get("DECODEGRAPH_CPU_THREADS")
        n = int(threads) if threads else max(1, (os.cpu_count() or 2) - 1)
        torch.set_num_threads(n)

    def attention_backend_cls(self) -> type[AttentionBackend]:
        return get_attn_backend("CPU_TORCH")

    def allocate_kv_cache(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Zeroed, on 2 MiB pages where the kernel allows (transparent huge pages in
        "madvise" mode): decode reads blocks scattered over tens of MB, and with 4 KiB
        pages most block reads miss the TLB (12 % off the decode operator at batch 256).
        The tensor starts on a 2 MiB boundary of a slightly larger allocation, so that
        its first blocks (the ones a fresh engine hands out first) are on huge pages too
        (an unaligned 16 MiB cache had up to its first 2 MiB on small pages)."""
        numel = math.prod(shape)
        per_page = _HUGE_PAGE // torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(numel + per_page, dtype=dtype, device=device)
        skip = (-raw.data_ptr() % _HUGE_PAGE) // raw.element_size()
        cache = raw[skip : skip + numel].view(shape)
        _advise_huge_pages(cache)
        return cache.zero_()  # first touch: the pages are faulted in huge

    def memory_allocated(self) -> int:
        """Resident memory of this process (what graph capture adds shows up here)."""
        try:
            resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return 0
        return resident_pages * os.sysconf("SC_PAGE_SIZE")

    def available_kv_cache_memory(self, gpu_memory_utilization: float, used_bytes: int) -> int:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(int(pages * _CPU_KV_CACHE_SHARE), _CPU_KV_CACHE_MAX_BYTES)


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned part of `tensor`'s memory; a no-op
    where the call is unavailable or refused."""
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
