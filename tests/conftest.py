"""Shared fixtures: the bundled stories260K model, the CPU operators, thread counts."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decodegraph.models.bundled import DEFAULT_MODEL, bundled_model_path

# The demo model shipped in the package (decodegraph/models/bundled/stories260K).
STORIES_DIR = bundled_model_path(DEFAULT_MODEL)

# Greedy output from the BOS token alone, as published with the model.
STORIES_GREEDY_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in "
    "the park. One day, she saw a big, red ball. She wanted to play with it, but it was too high."
)


@pytest.fixture(autouse=True)
def _no_background_build_outlives_its_test() -> Iterator[None]:
    """A dynamic decode graph that a test's engine set building in the background is made
    before the next test starts: a test's engine is rarely shut down, and the build's
    thread would otherwise run on beside later tests (their timings, the collector's
    counts)."""
    from decodegraph.graphs.graph_runner import BACKGROUND_BUILD_THREAD

    yield
    for thread in threading.enumerate():
        if thread.name == BACKGROUND_BUILD_THREAD:
            thread.join()


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    assert STORIES_DIR is not None, "the bundled stories260K model is missing from the package"
    return STORIES_DIR


@pytest.fixture(scope="session")
def cpu_ops() -> object:
    """decodegraph's CPU operators; skips where they cannot be built (no C++ compiler).
    Where a compiler is present, a failed build is a failure, not a skip."""
    from decodegraph.native import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is here but the CPU operators did not build")
        pytest.skip("the CPU operators cannot be built here (no C++ compiler)")
    return ops


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """For tests that change torch's intra-op thread count: put it back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
