"""Run a function on N gloo ranks, each in its own spawned process.

`run_on_ranks(fn, 2, *args)` starts two processes, joins them into one torch.distributed
group over loopback (a free port), makes them decodegraph's tensor-parallel group, calls
`fn(*args)` on each, and returns every rank's result in rank order. `fn` must be a
picklable top-level function (of a test module, or of tests/utils); it learns its rank
from `get_tensor_model_parallel_rank()`.

A rank that raises makes the parent raise `RankFailedError` naming the rank with the
child's traceback; one that dies or outlives `timeout_s` does too. Either way every
child is ended before the call returns, so no test leaves processes behind. Spawning a
process with torch costs seconds: batch a test's cases into one call.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailedError(RuntimeError):
    """A rank raised, died or ran past its time."""


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world_size: int,
    init_method: str,
    timeout_s: float,
    num_threads: int,
    results: Any,
) -> None:
    try:
        import torch

        torch.set_num_threads(num_threads)
        from decodegraph.distributed.parallel_state import (
            destroy_distributed_environment,
            init_distributed_environment,
        )

        init_distributed_environment(world_size, rank, init_method, "gloo", timeout_s=timeout_s)
        try:
            value = fn(*args)
        finally:
            destroy_distributed_environment()
        # Pickled here by value: a tensor sent through torch's shared memory would need
        # this process alive until the parent read it.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def _next_report(
    results: Any, procs: list, reported: dict[int, Any], deadline: float, timeout_s: float
) -> tuple[int, bool, Any]:
    """The next (rank, ok, value) a child sends; RankFailedError if a child that has not
    reported is gone, or when the time is up."""
    while True:
        try:
            return results.get(timeout=0.2)
        except queue.Empty:
            pass
        dead = [(r, p) for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
        if dead:
            try:
                return results.get(timeout=1.0)  # it may have reported just before exiting
            except queue.Empty:
                rank, p = dead[0]
                raise RankFailedError(
                    f"rank {rank} (pid {p.pid}) died: exit code {p.exitcode}"
                ) from None
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - set(reported))
            raise RankFailedError(f"ranks {missing} did not finish within {timeout_s:.0f} s")


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    num_threads: int = 1,
) -> list[Any]:
    """`fn(*args)` on `world_size` gloo ranks in spawned processes; their results in
    rank order. Raises RankFailedError for the first rank that fails."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, args, rank, world_size, init_method, timeout_s, num_threads, results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        while len(values) < world_size:
            rank, ok, value = _next_report(results, procs, values, deadline, timeout_s)
            if not ok:
                raise RankFailedError(f"rank {rank} raised:\n{value}")
            values[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [values[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=5.0)
        results.close()
