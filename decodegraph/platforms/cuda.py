"""NVIDIA GPUs: graphs are torch.cuda.CUDAGraph sharing one memory pool."""

from __future__ import annotations

import importlib.util
from typing import ClassVar

import torch

from decodegraph.attention.backends.base import AttentionBackend
from decodegraph.attention.selector import get_attn_backend
from decodegraph.platforms.base import Platform


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"
    graph_capture_kind: ClassVar[str | None] = "cuda"
    default_capture_sizes: ClassVar[list[int]] = [1, 2, 4] + list(range(8, 257, 8))

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def attention_backend_cls(self) -> type[AttentionBackend]:
        """TRITON_ATTN (one kernel per layer, full graphs for any batch) where triton is
        installed; else the torch-op fallback, graph-safe for uniform decode only."""
        triton = importlib.util.find_spec("triton") is not None
        return get_attn_backend("TRITON_ATTN" if triton else "CUDA_TORCH")

    def available_kv_cache_memory(self, gpu_memory_utilization: float, used_bytes: int) -> int:
        free, total = torch.cuda.mem_get_info()
        # The budget is a share of the whole device; what the process already holds
        # (weights, profiled activations, graph pool) comes out of it.
        return max(0, int(total * gpu_memory_utilization) - (total - free))

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()
