"""The "mp" executor with real spawned processes and a gloo process group (the model-free
DummyWorker), on one node and on two "nodes" over loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from decodegraph.executor import multiproc
from decodegraph.executor.abstract import Executor, WorkerDiedError, WorkerError
from decodegraph.executor.mp_ranks import cpu_shares
from decodegraph.executor.multiproc import MultiprocExecutor
from tests.executor.dummy_worker import QUALNAME, dummy_config
from tests.utils.processes import free_port_pair, gone, live_children

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def executor() -> Iterator[MultiprocExecutor]:
    e = Executor.get_class(dummy_config(tensor_parallel_size=2))(
        dummy_config(tensor_parallel_size=2)
    )
    yield e
    e.shutdown()


def test_the_default_backend_above_one_rank_is_mp() -> None:
    assert Executor.get_class(dummy_config(tensor_parallel_size=2)) is MultiprocExecutor


def test_collective_rpc_returns_every_ranks_result_in_rank_order(
    executor: MultiprocExecutor,
) -> None:
    assert executor.collective_rpc("echo", ("hi",)) == [(0, "hi"), (1, "hi")]
    assert executor.collective_rpc("sleep", (0.2,), {"on_rank": 0}) == [0, 1]


def test_an_all_reduce_runs_across_the_ranks_and_a_step_returns_rank_0s_result(
    executor: MultiprocExecutor,
) -> None:
    assert executor.collective_rpc("all_reduce", (2.0,)) == [4.0, 4.0]
    # (1 + 0) + (1 + 1)
    assert executor.execute_model(1.0) == 3.0


def test_each_rank_is_a_child_process_pinned_to_its_share_of_the_cores(
    executor: MultiprocExecutor,
) -> None:
    infos = executor.collective_rpc("process_info")
    assert [i["rank"] for i in infos] == [0, 1] == [i["local_rank"] for i in infos]
    assert all(i["ppid"] == os.getpid() for i in infos)
    assert infos[0]["pid"] != infos[1]["pid"]
    if hasattr(os, "sched_getaffinity"):
        assert [i["affinity"] for i in infos] == cpu_shares(2)
        assert not set(infos[0]["affinity"]) & set(infos[1]["affinity"])
    cores = len(cpu_shares(1)[0])
    expected = os.environ.get("DECODEGRAPH_CPU_THREADS") or str(max(1, cores // 2))
    assert [i["cpu_threads"] for i in infos] == [expected, expected]


def test_check_health_answers_while_a_call_is_in_flight(executor: MultiprocExecutor) -> None:
    """What /health does while the engine thread runs a step."""
    call = threading.Thread(target=executor.collective_rpc, args=("sleep", (2.0,)))
    call.start()
    time.sleep(0.3)
    start = time.monotonic()
    executor.check_health()
    assert time.monotonic() - start < 1.0
    call.join()


def test_a_worker_exception_is_a_worker_error_with_its_rank_and_remote_traceback(
    executor: MultiprocExecutor,
) -> None:
    with pytest.raises(WorkerError) as info:
        executor.collective_rpc("raise_error", (1,))
    err = info.value
    assert not isinstance(err, WorkerDiedError)
    assert (err.rank, err.method) == (1, "raise_error")
    assert "dummy_worker.py" in err.remote_traceback and "in raise_error" in err.remote_traceback
    assert "ValueError: asked to fail on rank 1" in str(err)
    assert isinstance(err.__cause__, ValueError)
    # Every rank answered: the executor is still usable.
    executor.check_health()
    assert executor.collective_rpc("all_reduce", (1.0,)) == [2.0, 2.0]


def test_an_unpicklable_result_is_a_worker_error(executor: MultiprocExecutor) -> None:
    with pytest.raises(WorkerError, match="rank 0 raised in 'unpicklable'"):
        executor.collective_rpc("unpicklable")
    assert executor.collective_rpc("echo", (1,)) == [(0, 1), (1, 1)]


def test_a_killed_worker_fails_the_pending_call_at_once_and_check_health() -> None:
    before = live_children()
    e = MultiprocExecutor(dummy_config(tensor_parallel_size=2))
    pid = e.collective_rpc("pid")[1]
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"worker rank 1 \(pid {pid}\) died: exit code -9"):
        e.collective_rpc("sleep", (60.0,))
    assert time.monotonic() - start < 5.0
    with pytest.raises(WorkerDiedError, match="rank 1"):
        e.check_health()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        e.execute_model(1.0)
    e.shutdown()
    e.shutdown()
    assert live_children() <= before


def test_a_hung_worker_fails_the_call_after_its_time_out() -> None:
    before = live_children()
    e = MultiprocExecutor(dummy_config(tensor_parallel_size=2))
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) did not answer 'sleep'"):
        e.collective_rpc("sleep", (60.0,), {"on_rank": 1}, timeout_s=1.0)
    assert time.monotonic() - start < 5.0
    with pytest.raises(WorkerDiedError):
        e.check_health()
    e.shutdown()
    assert live_children() <= before


def test_an_error_while_the_other_rank_waits_in_a_collective_fails_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 raises; rank 0 waits for it in an all-reduce that never completes: after
    AFTER_ERROR_S the executor fails, with rank 1's error as the cause."""
    monkeypatch.setattr(multiproc, "AFTER_ERROR_S", 1.0)
    e = MultiprocExecutor(dummy_config(tensor_parallel_size=2))
    start = time.monotonic()
    with pytest.raises(
        WorkerDiedError, match="rank 0 .* after worker rank 1 raised .*asked to fail on rank 1"
    ) as info:
        e.collective_rpc("raise_then_all_reduce", (1,))
    assert time.monotonic() - start < 5.0
    assert isinstance(info.value.__cause__, WorkerError) and info.value.__cause__.rank == 1
    e.shutdown()


def test_a_worker_that_fails_to_start_is_a_worker_error_and_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(multiproc, "AFTER_ERROR_S", 1.0)
    monkeypatch.setenv("DUMMY_WORKER_FAIL_INIT_RANK", "1")
    before = live_children()
    with pytest.raises(WorkerError, match="rank 1 raised in 'init_device'.*init failed"):
        MultiprocExecutor(dummy_config(tensor_parallel_size=2))
    assert live_children() <= before


def test_workers_die_with_a_killed_driver() -> None:
    script = (
        "import json, time\n"
        "from decodegraph.executor.multiproc import MultiprocExecutor\n"
        "from tests.executor.dummy_worker import dummy_config\n"
        "e = MultiprocExecutor(dummy_config(tensor_parallel_size=2))\n"
        "print('pids', json.dumps(e.collective_rpc('pid')), flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        # Marked: a torch whose gloo logs its connections to stdout (2.10 on aarch64) has
        # the workers print lines of their own before it.
        lines = iter(driver.stdout.readline, "")
        pids = next(json.loads(line[5:]) for line in lines if line.startswith("pids "))
        assert len(pids) == 2
        driver.kill()
        driver.wait(10)
        assert gone(pids, within_s=5.0), "workers outlived their driver"
    finally:
        driver.kill()
        driver.wait(10)


def test_a_driver_that_exits_without_shutdown_stops_its_workers_at_exit() -> None:
    """The exit hook runs before multiprocessing's, which would wait on live workers."""
    script = (
        "import json\n"
        "from decodegraph.executor.multiproc import MultiprocExecutor\n"
        "from tests.executor.dummy_worker import dummy_config\n"
        "e = MultiprocExecutor(dummy_config(tensor_parallel_size=2))\n"
        "print(json.dumps(e.collective_rpc('pid')), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, env=env, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert gone(json.loads(done.stdout.splitlines()[-1]), within_s=2.0)


def test_two_nodes_on_loopback_run_one_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0: the driver and rank 0; node 1: `decodegraph serve --headless` and rank 1."""
    monkeypatch.setenv("DECODEGRAPH_RPC_AUTHKEY", "test-secret")
    port = free_port_pair()
    before = live_children()
    headless = subprocess.Popen(
        [
            sys.executable, "-m", "decodegraph", "serve", "--headless", "--device", "cpu",
            "-tp", "2", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--worker-cls", QUALNAME,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        config = dummy_config(tensor_parallel_size=2, nnodes=2, master_port=port)
        e = MultiprocExecutor(config)
        infos = e.collective_rpc("process_info")
        assert [i["rank"] for i in infos] == [0, 1]
        assert [i["local_rank"] for i in infos] == [0, 0]
        assert infos[0]["ppid"] == os.getpid() and infos[1]["ppid"] == headless.pid
        assert e.collective_rpc("all_reduce", (3.0,)) == [6.0, 6.0]
        assert e.execute_model(1.0) == 3.0
        e.check_health()
        e.shutdown()
        # The driver's shutdown ends node 1's ranks, and with them `serve --headless`.
        assert headless.wait(30) == 0
        assert live_children() <= before
    finally:
        headless.kill()
        headless.wait(10)


def test_a_rank_leaves_the_heap_it_started_with_frozen_until_its_capture() -> None:
    """A spawned rank's start-up collections skip what it imported (gc_utils); from its
    capture on, it collects everything, with the collector on."""
    e = MultiprocExecutor(dummy_config(tensor_parallel_size=2))
    try:
        states = e.collective_rpc("gc_state")
        assert all(enabled and frozen > 0 for enabled, frozen in states), states
        e.collective_rpc("capture_graphs")
        assert e.collective_rpc("gc_state") == [(True, 0), (True, 0)]
    finally:
        e.shutdown()


def test_shutdown_stops_every_worker_and_is_idempotent(executor: MultiprocExecutor) -> None:
    pids = executor.collective_rpc("pid")
    executor.shutdown()
    executor.shutdown()
    assert gone(pids, within_s=1.0)
    with pytest.raises(RuntimeError, match="shut down"):
        executor.collective_rpc("echo", (1,))
