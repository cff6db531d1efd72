"""Helpers for tests that watch Inductor."""

from __future__ import annotations

import pytest


def count_compiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an item at each Inductor compile (`compile_fx`) in this process
    from now on; a forked child's stay in the child."""
    import torch._inductor.compile_fx as compile_fx

    compiles: list[int] = []
    original = compile_fx.compile_fx

    def counted(*args: object, **kwargs: object) -> object:
        compiles.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx", counted)
    return compiles
