"""Platform contract: what differs between CPU, CUDA (and, later, Ascend NPU).

A new device is one module here: its device and dtype defaults, how it makes and
replays graphs (`graph_capture_kind`), how it synchronises, its memory statistics,
its distributed backend and its attention backend.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from decodegraph.attention.backends.base import AttentionBackend


class Platform:
    """Base class; one instance per process (see `current_platform`)."""

    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    # "cpu" (traced op graphs), "cuda" (torch.cuda.CUDAGraph), or None (no graphs).
    graph_capture_kind: ClassVar[str | None] = None
    # Default capture sizes: what the benchmarks showed best on this platform.
    default_capture_sizes: ClassVar[list[int]] = []
    # Inductor options for CPU graphs; compilation_config.inductor_compile_config wins.
    default_inductor_options: ClassVar[dict[str, object]] = {}

    @property
    def supports_graphs(self) -> bool:
        return self.graph_capture_kind is not None

    def configure_process(self) -> None:
        """Process-wide settings the platform wants before the engine starts."""

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on CPU)."""

    def attention_backend_cls(self) -> type[AttentionBackend]:
        raise NotImplementedError

    def allocate_kv_cache(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """One layer's K or V cache, zeroed."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def available_kv_cache_memory(self, gpu_memory_utilization: float, used_bytes: int) -> int:
        """Bytes the KV cache may take, after weights, activations and graphs."""
        raise NotImplementedError

    def memory_allocated(self) -> int:
        return 0

    def reset_peak_memory(self) -> None:
        """Start a peak-memory measurement (profiling run)."""

    def peak_memory_allocated(self) -> int:
        return 0
