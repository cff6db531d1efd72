"""A graph's compile in a forked copy of the process, off the engine's GIL.

A graph made in the background (graphs/graph_runner.py) is traced and compiled on a
thread of the engine's process. Inductor's lowering and code generation are Python,
seconds of it from a cold cache, and they hold the GIL most of the time; a step beside
them lets the GIL go at each operator and waits to get it back, so a small model's eager
steps run many times slower while a build runs.

The build thread first makes the graph from the caches only
(`Platform.cached_graphs_only`: a module an earlier process compiled is loaded, and
nothing is forked). Where that finds none, `run_forked` runs the same build in a child
made by fork: a copy of the process as it is (the model, Inductor already imported and
set up), whose only thread is the one that forked. The child compiles, runs the graph once over a dummy
batch in its own copy of the buffers (which checks it and enters it in the compiled-graph
index, platforms/cpu_graph_cache.py) and exits; the parent's thread waits for it without
the GIL, then makes the graph as before, which now finds Inductor's module in the index
and only loads it. Nothing the child writes reaches the parent's memory; what it leaves
is files in the caches. Where the child fails or runs too long, the parent builds as it
would have (nothing is lost but the time); a child that runs too long writes its stacks
to standard error first.

Fork copies no thread but the caller: a lock another thread holds at the fork stays
held in the child for ever. The caller holds the engine's own locks across the fork
(so no step and no other build is mid-way), and the thread pools the build would use
start afresh in the child (`os.register_at_fork` in platforms/inductor_cpp.py and in
Inductor's async_compile, and `_fresh_pools` here). The child also lets go of the
parent's sockets and pipes (a server's connections), and dies with the thread that
forked it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

from decodegraph.platforms.base import graph_build_lock, module_call_lock

logger = logging.getLogger(__name__)

# "0" builds on the thread only (as before this module), for a process that must not
# fork (one that holds resources a copy would keep open, such as connections).
FORKED_BUILDS_ENV = "DECODEGRAPH_FORKED_GRAPH_BUILDS"
# How long the parent waits for a child before it stops it and builds itself: far longer
# than one graph's compile takes (docs/performance.md), so a child still running is stuck.
CHILD_TIMEOUT_S = 300.0
# Before the parent stops it, a child past this share of the wait writes every thread's
# Python stack to its standard error (where it is stuck, for a report).
_STACKS_AT = 0.9
_POLL_S = 0.02


def forked_builds_enabled() -> bool:
    value = os.environ.get(FORKED_BUILDS_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{FORKED_BUILDS_ENV}: must be 0 or 1, got {value!r}")
    return value == "1" and hasattr(os, "fork") and sys.platform == "linux"


def run_forked(
    work: Callable[[], bool],
    cancelled: Callable[[], bool],
    timeout_s: float = CHILD_TIMEOUT_S,
) -> bool:
    """Run `work` in a forked child and wait for it (polling, so that `cancelled` can stop
    it). True where the child ran it to the end and it returned True."""
    with graph_build_lock, module_call_lock:  # no step, trace or compile mid-way
        try:
            pid = os.fork()
        except OSError as e:  # no memory or no process left for a copy
            logger.debug("no forked graph build: %s", e)
            return False
        if pid == 0:
            _child(work, timeout_s * _STACKS_AT)  # never returns
    start = time.monotonic()
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else's handler: its result is lost
            logger.debug("forked graph build %d reaped elsewhere", pid)
            return False
        if done:
            ok = os.waitstatus_to_exitcode(status) == 0
            if not ok:
                logger.debug("forked graph build ended with status %d", status)
            return ok
        if cancelled() or time.monotonic() - start > timeout_s:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            if not cancelled():
                logger.warning(
                    "a graph's build in a forked process ran past %.0f s; building it here",
                    timeout_s,
                )
            return False
        time.sleep(_POLL_S)


def _child(work: Callable[[], bool], stacks_after_s: float) -> None:
    code = 1
    try:
        faulthandler.dump_traceback_later(stacks_after_s, exit=False)
        # The parent reports; the child's logs would say the same again, or say what
        # only the parent should (a failure the parent then meets for itself).
        logging.disable(logging.CRITICAL)
        _die_with_parent()
        _let_go_of_connections()
        _fresh_pools()
        # Not torch.set_num_threads: Inductor writes the thread count into the code it
        # generates. OpenMP starts a team afresh here: the forking thread never led one.
        code = 0 if work() else 1
    except BaseException:  # noqa: BLE001 - any failure: the parent builds for itself
        code = 1
    finally:
        # No flush: the streams' buffers hold the parent's unwritten output too.
        os._exit(code)


def _die_with_parent() -> None:
    """The child is killed if the thread that forked it ends (the process exiting)."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _let_go_of_connections() -> None:
    """Every inherited socket and pipe but the standard streams becomes /dev/null, at the
    same number: a connection the parent closes meanwhile closes for its peer at once
    (not when the child exits), and nothing here writes to the parent's pipes. The
    numbers stay taken, so that no file the child opens gets one of them."""
    import stat

    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd <= 2 or fd == null:
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode):
            os.dup2(null, fd)
    os.close(null)


def _fresh_pools() -> None:
    """Thread pools whose threads the fork did not copy, emptied so that the child's
    first use starts new ones (a copied pool with idle threads on its books would queue
    work for threads that do not exist)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.AsyncCompile.pool.cache_clear()
