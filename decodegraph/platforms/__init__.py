"""Platforms: pick the one for a device type."""

from __future__ import annotations

from decodegraph.platforms.base import Platform


def get_platform(device_type: str) -> Platform:
    """The platform for "cpu" or "cuda" (an Ascend "npu" module would plug in here)."""
    if device_type == "cpu":
        from decodegraph.platforms.cpu import CpuPlatform

        return CpuPlatform()
    if device_type == "cuda":
        from decodegraph.platforms.cuda import CudaPlatform

        return CudaPlatform()
    raise ValueError(f"device: no platform for {device_type!r} (cpu, cuda)")
