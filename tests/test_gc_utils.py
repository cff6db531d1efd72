"""The collector at start-up: paused while modules import, the heap the engine started
with frozen while it starts, and everything as it was once it has; the heap frozen for
the interpreter's teardown, except where triton is loaded."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from decodegraph import LLM
from decodegraph.gc_utils import collector_paused, freeze_at_exit, frozen_heap
from decodegraph.worker.model_runner import ModelRunner
from tests.utils.triton import NO_TRITON, env_with_triton, triton_findable


@pytest.fixture
def collector_state() -> Iterator[None]:
    """Whatever a test does to the collector is undone."""
    was_enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    if gc.get_freeze_count() != frozen:
        gc.unfreeze()
    (gc.enable if was_enabled else gc.disable)()


def _cycle() -> None:
    """A reference cycle that only the collector can free."""
    a: list = []
    a.append(a)


@pytest.mark.usefixtures("collector_state")
@pytest.mark.parametrize("enabled", [True, False])
def test_collector_paused_restores_the_state_it_found(enabled: bool) -> None:
    (gc.enable if enabled else gc.disable)()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled() is enabled
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("an import failed")
    assert gc.isenabled() is enabled


@pytest.mark.usefixtures("collector_state")
def test_frozen_heap_freezes_what_was_alive_until_the_outermost_block_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted as calls of gc.freeze and gc.unfreeze, not as frozen objects alone: a
    thread an earlier test left (a server's, a build's) may free frozen objects
    meanwhile, which lowers the count."""
    calls: list[str] = []
    for name in ("freeze", "unfreeze"):
        real = getattr(gc, name)
        monkeypatch.setattr(gc, name, lambda real=real, name=name: calls.append(name) or real())
    gc.collect()
    assert gc.get_freeze_count() == 0
    kept = [[] for _ in range(100)]  # tracked by the collector
    with frozen_heap():
        assert calls == ["freeze"] and gc.get_freeze_count() >= len(kept)
        made_inside = [[] for _ in range(100)]
        with frozen_heap():
            pass
        # The inner block froze nothing more, and its end left the outer one's frozen.
        assert calls == ["freeze"] and gc.get_freeze_count() >= len(kept)
        # Objects made inside are collected as usual.
        gc.collect()
        _cycle()
        assert gc.collect() >= 1
    assert calls == ["freeze", "unfreeze"] and gc.get_freeze_count() == 0
    assert kept and made_inside


@pytest.mark.usefixtures("collector_state")
def test_an_engine_starts_with_its_heap_frozen_and_leaves_the_collector_as_it_was(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gc.enable()
    gc.collect()
    assert gc.get_freeze_count() == 0
    seen: list[int] = []
    load = ModelRunner.load_model

    def load_model(self: ModelRunner, *args: object) -> None:
        seen.append(gc.get_freeze_count())
        load(self, *args)

    monkeypatch.setattr(ModelRunner, "load_model", load_model)
    llm = LLM(str(stories_dir), max_model_len=64, max_num_seqs=4, enforce_eager=True)
    assert seen and seen[0] > 0, "the modules imported before start-up were not frozen"
    assert gc.get_freeze_count() == 0
    assert gc.isenabled()
    del llm


@pytest.mark.usefixtures("collector_state")
def test_the_heap_is_frozen_at_exit_unless_triton_is_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    freeze_at_exit()
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
    monkeypatch.setitem(sys.modules, "triton", object())
    freeze_at_exit()
    assert gc.get_freeze_count() == 0


@pytest.mark.skipif(not triton_findable(), reason=NO_TRITON)
def test_a_process_with_triton_loaded_ends_without_nanobinds_leak_report() -> None:
    """torch's Dynamo imports triton wherever it is installed (any CUDA build of torch
    brings it), and nanobind, triton's binding library, reports every object of its own
    still alive at teardown: a frozen heap printed dozens of "leaked" lines at the end of
    every run."""
    env = env_with_triton()
    script = "import decodegraph, torch._dynamo, triton"  # (Dynamo of 2.10 does not import it)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]
