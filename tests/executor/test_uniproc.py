"""The "uni" executor: rank 0 of 1 in the driver's process, a step a plain call."""

from __future__ import annotations

import os

import pytest

from decodegraph.executor.abstract import Executor
from decodegraph.executor.uniproc import UniProcExecutor
from tests.executor.dummy_worker import dummy_config


@pytest.mark.parametrize(
    "parallel, name",
    [
        ({}, "UniProcExecutor"),
        ({"tensor_parallel_size": 2}, "MultiprocExecutor"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, "RayExecutor"),
    ],
)
def test_get_class_follows_the_backend(parallel: dict, name: str) -> None:
    assert Executor.get_class(dummy_config(**parallel)).__name__ == name


def test_the_worker_runs_in_process_and_a_step_calls_it_directly() -> None:
    e = Executor.get_class(dummy_config())(dummy_config())
    try:
        assert isinstance(e, UniProcExecutor)
        assert e.collective_rpc("pid") == [os.getpid()]
        assert e.collective_rpc("all_reduce", (2.0,)) == [2.0]
        # No wrapper on the step path: the executor's execute_model is the worker's.
        assert e.execute_model == e.driver_worker.execute_model
        assert e.execute_model(1.0) == 1.0
        e.check_health()
    finally:
        e.shutdown()
        e.shutdown()


def test_a_worker_exception_arrives_as_it_was_raised_and_the_executor_goes_on() -> None:
    """In process there is nothing to wrap: a bad checkpoint's ValueError stays one, as
    the engine's callers expect."""
    e = UniProcExecutor(dummy_config())
    try:
        with pytest.raises(ValueError):
            e.collective_rpc("raise_error")
        assert e.collective_rpc("echo", ("ok",)) == [(0, "ok")]
    finally:
        e.shutdown()
