"""The "ray" executor on a local Ray cluster (two CPUs), started once for the module."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

import decodegraph
from decodegraph.executor.abstract import Executor, WorkerDiedError, WorkerError
from decodegraph.executor.ray_executor import RayExecutor
from tests.executor.dummy_worker import dummy_config
from tests.utils.processes import gone

pytestmark = pytest.mark.timeout(120)


def ray_config() -> object:
    return dummy_config(tensor_parallel_size=2, distributed_executor_backend="ray")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    assert not ray.is_initialized()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def executor(ray_cluster: None) -> Iterator[RayExecutor]:
    e = Executor.get_class(ray_config())(ray_config())
    yield e
    e.shutdown()


def test_collective_rpc_returns_every_actors_result_in_rank_order(executor: RayExecutor) -> None:
    assert executor.collective_rpc("echo", ("hi",)) == [(0, "hi"), (1, "hi")]
    assert executor.collective_rpc("all_reduce", (2.0,)) == [4.0, 4.0]
    assert executor.execute_model(1.0) == 3.0
    executor.check_health()


def test_actors_import_the_drivers_decodegraph_and_get_their_thread_share(
    executor: RayExecutor,
) -> None:
    infos = executor.collective_rpc("process_info")
    assert [i["local_rank"] for i in infos] == [0, 1]
    assert {Path(i["decodegraph"]) for i in infos} == {Path(decodegraph.__file__)}
    expected = os.environ.get("DECODEGRAPH_CPU_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
    assert [i["cpu_threads"] for i in infos] == [expected, expected]


def test_check_health_answers_while_a_call_is_in_flight(executor: RayExecutor) -> None:
    """What /health does while the engine thread runs a step."""
    call = threading.Thread(target=executor.collective_rpc, args=("sleep", (2.0,)))
    call.start()
    time.sleep(0.3)
    start = time.monotonic()
    executor.check_health()
    assert time.monotonic() - start < 1.0
    call.join()


def test_a_worker_exception_is_a_worker_error_and_the_actors_keep_working(
    executor: RayExecutor,
) -> None:
    with pytest.raises(WorkerError, match="rank 1 raised in 'raise_error'") as info:
        executor.collective_rpc("raise_error", (1,))
    assert not isinstance(info.value, WorkerDiedError)
    assert "in raise_error" in info.value.remote_traceback
    assert executor.collective_rpc("all_reduce", (1.0,)) == [2.0, 2.0]


def test_a_killed_actor_fails_the_pending_call_and_shutdown_ends_every_actor(
    executor: RayExecutor,
) -> None:
    # The module's executor goes last: free its two CPUs for this one.
    executor.shutdown()
    e = RayExecutor(ray_config())
    pids = e.collective_rpc("pid")
    threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"worker rank 1 \(pid {pids[1]}, Ray actor\) died"):
        e.collective_rpc("sleep", (60.0,))
    assert time.monotonic() - start < 10.0
    with pytest.raises(WorkerDiedError, match="rank 1"):
        e.check_health()
    e.shutdown()
    e.shutdown()
    assert gone(pids, within_s=10.0)
