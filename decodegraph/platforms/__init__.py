"""Platforms: one module per device kind, found here by name.

`DeviceConfig.device` names a platform. A new device (an Ascend NPU, say) is one module
in this folder with a `Platform` subclass and one line in `_PLATFORMS`; out-of-tree and
test platforms call `register_platform`.
"""

from __future__ import annotations

import importlib

from decodegraph.platforms.base import Platform

# name -> "module:class"; modules are imported only when chosen.
_PLATFORMS: dict[str, str | type[Platform]] = {
    "cpu": "decodegraph.platforms.cpu:CpuPlatform",
    "cuda": "decodegraph.platforms.cuda:CudaPlatform",
}
_BUILT_IN = frozenset(_PLATFORMS)


def register_platform(name: str, platform: str | type[Platform]) -> None:
    """Make `platform` (a class, or "module:class") the one named `name`."""
    _PLATFORMS[name] = platform


def unregister_platform(name: str) -> None:
    """Forget a registered platform (the built-in ones stay)."""
    if name not in _BUILT_IN:
        _PLATFORMS.pop(name, None)


def platform_names() -> list[str]:
    """Every platform name a DeviceConfig may give."""
    return list(_PLATFORMS)


def platform_class(name: str) -> type[Platform]:
    """The platform class named `name` (its module imported on first use)."""
    entry = _PLATFORMS.get(name)
    if entry is None:
        raise ValueError(f"device: no platform named {name!r} ({', '.join(_PLATFORMS)})")
    if isinstance(entry, str):
        module, cls = entry.split(":")
        entry = getattr(importlib.import_module(module), cls)
    return entry


def get_platform(name: str) -> Platform:
    """A new instance of the platform named `name`."""
    return platform_class(name)()
