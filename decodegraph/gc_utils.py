"""Python's cyclic garbage collector at start-up (vLLM's module name).

Importing torch, transformers' configuration classes and, through them, Dynamo makes
about half a million objects that live as long as the process. The collector walks
every object it tracks in a full collection, and the young generations often enough
that it runs hundreds of times while those modules load, six of them full; the engine's
start-up (loading, tracing, Inductor's compiles, the collection before capture) walks
the same heap again. Neither frees anything worth the walk: the imported modules are
never garbage, and a start-up's own garbage is young.

- `collector_paused`: no automatic collection while the package's modules import
  (`decodegraph.LLM` and the other lazy names, the CLI's commands, a spawned rank's
  modules and worker); the collector is back as it was afterwards.
- `freeze_at_exit` (atexit, registered when the package is imported): the collections
  of the interpreter's teardown walk every object torch, Dynamo and transformers made,
  for nothing, as the process is ending: freezing takes them out of reach.
- `frozen_heap`: every object alive when the engine starts is out of the collector's
  reach until start-up ends (`gc.freeze`), so the collections of start-up, automatic or
  the one before capture, walk only what start-up made. At the end everything is
  tracked again (`gc.unfreeze`): the running engine collects as any process does. A
  spawned rank does the same from its worker's start to its capture (executor/mp_ranks.py).

docs/performance.md has what each saves.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

# How many frozen_heap blocks are open: only the outermost freezes and unfreezes
# (gc.unfreeze takes back every frozen object, an inner block's and an outer's alike).
_frozen_depth = 0


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside the block (explicit `gc.collect` calls still run);
    the collector is enabled afterwards only if it was before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Objects alive at the outermost entry are left out of every collection until its
    exit (`gc.freeze` / `gc.unfreeze`); nested blocks change nothing. Objects made
    inside are collected as usual."""
    global _frozen_depth
    if _frozen_depth == 0:
        gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0:
            gc.unfreeze()


def freeze_at_exit() -> None:
    """At exit, every object out of the teardown's collections (`gc.freeze`), except where
    triton is loaded. Triton's compiler is a nanobind extension, and nanobind reports
    each of its objects still alive when the extension is torn down, which a frozen
    cycle always is: dozens of lines of "leaked instance" at the end of every run on a
    machine where triton is installed (any CUDA build of torch brings it), GPU or none.
    There the teardown collects as Python's does."""
    if "triton" not in sys.modules:
        gc.freeze()
