"""ParallelConfig: vLLM's names, defaults, and a ValueError naming the field for each
bad value."""

from __future__ import annotations

import pytest

from decodegraph.config import ParallelConfig


@pytest.mark.parametrize(
    "tp, nnodes, expected",
    [(1, 1, "uni"), (2, 1, "mp"), (4, 2, "mp")],
)
def test_the_backend_defaults_to_uni_at_one_rank_and_mp_above(
    tp: int, nnodes: int, expected: str
) -> None:
    pc = ParallelConfig(tensor_parallel_size=tp, nnodes=nnodes, master_port=29500)
    assert pc.distributed_executor_backend == expected
    assert pc.world_size == tp
    assert pc.local_world_size == tp // nnodes


def test_defaults_are_loopback_a_free_port_and_the_engines_worker() -> None:
    pc = ParallelConfig()
    assert (pc.nnodes, pc.node_rank, pc.master_addr, pc.master_port) == (1, 0, "127.0.0.1", None)
    assert pc.worker_cls == "decodegraph.worker.worker.Worker"


def test_tensor_parallel_size_above_one_is_accepted() -> None:
    assert ParallelConfig(tensor_parallel_size=2).tensor_parallel_size == 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 3, "nnodes": 2, "master_port": 29500}, "tensor_parallel_size"),
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            "distributed_executor_backend",
        ),
        ({"distributed_executor_backend": "threads"}, "distributed_executor_backend"),
        ({"nnodes": 0}, "nnodes"),
        (
            {
                "tensor_parallel_size": 2,
                "nnodes": 2,
                "master_port": 29500,
                "distributed_executor_backend": "ray",
            },
            "nnodes",
        ),
        (
            {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "master_port": 29500},
            "node_rank",
        ),
        ({"node_rank": -1}, "node_rank"),
        ({"master_addr": ""}, "master_addr"),
        ({"master_port": 0}, "master_port"),
        ({"master_port": 65535}, "master_port"),
        ({"master_port": True}, "master_port"),
        ({"tensor_parallel_size": 2, "nnodes": 2}, "master_port"),
        ({"worker_cls": "Worker"}, "worker_cls"),
    ],
)
def test_a_bad_value_is_a_value_error_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        ParallelConfig(**kwargs)
