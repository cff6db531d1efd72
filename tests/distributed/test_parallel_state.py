"""The tensor-parallel group and its collectives: eager, traced, and in a CPU graph.

Two gloo ranks in spawned processes (tests/utils/distributed.py); every case of a kind
runs in one spawn, since starting torch processes costs seconds.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from decodegraph.distributed import parallel_state as ps
from decodegraph.platforms.cpu_graph import CpuGraph
from tests.utils.distributed import RankFailedError, run_on_ranks


def _rank_tensor(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank


def _reduce_then_gather(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = ps.tensor_model_parallel_all_reduce(x * 2)
    return y + 1, ps.tensor_model_parallel_all_gather(x, dim=-1)


def _collectives_on_every_path() -> dict[str, object]:
    rank = ps.get_tensor_model_parallel_rank()
    x = _rank_tensor(rank)
    out: dict[str, object] = {
        "shm": ps.get_tp_group().shm,
        "rank": rank,
        "world_size": ps.get_tensor_model_parallel_world_size(),
        "all_reduce": ps.tensor_model_parallel_all_reduce(x),
        "gather_0": ps.tensor_model_parallel_all_gather(x, dim=0),
        "gather_last": ps.tensor_model_parallel_all_gather(x, dim=-1),
    }
    group = ps.get_tp_group()
    ids = torch.tensor([7, 8, 9]) if rank == 0 else torch.zeros(3, dtype=torch.int64)
    out["broadcast"] = group.broadcast(ids).clone()
    out["broadcast_object"] = group.broadcast_object({"ids": [1, 2]} if rank == 0 else None)

    gm = make_fx(_reduce_then_gather)(x)
    out["traced_ops"] = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
    other = x + 100  # replay on new values
    out["traced"] = gm(other)
    # decodegraph's CPU graph path: traced and compiled by Inductor, replayed in place;
    # asked for the platform's C++ wrapper, which cannot call gloo's collectives (the
    # Python wrapper does then).
    buf = x.clone()
    options = {"cpp_wrapper": True}
    graph = CpuGraph("tp", _reduce_then_gather, [buf], use_inductor=True, inductor_options=options)
    buf.copy_(other)
    out["inductor"] = [t.clone() for t in graph.replay()]
    out["eager_of_other"] = _reduce_then_gather(other)
    return out


def test_collectives_are_correct_eager_traced_and_inductor_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # gloo's functional collectives: the shared-memory ones (on by default on one host)
    # have their own tests (test_shm_all_reduce.py).
    monkeypatch.setenv("DECODEGRAPH_CPU_SHM_ALLREDUCE", "0")
    results = run_on_ranks(_collectives_on_every_path, 2)
    x0, x1 = _rank_tensor(0), _rank_tensor(1)
    for rank, r in enumerate(results):
        assert (r["rank"], r["world_size"], r["shm"]) == (rank, 2, None)
        torch.testing.assert_close(r["all_reduce"], x0 + x1)
        torch.testing.assert_close(r["gather_0"], torch.cat((x0, x1), 0))
        torch.testing.assert_close(r["gather_last"], torch.cat((x0, x1), 1))
        assert r["broadcast"].tolist() == [7, 8, 9]
        assert r["broadcast_object"] == {"ids": [1, 2]}
        ops = r["traced_ops"]
        assert "_c10d_functional.all_reduce.default" in ops
        assert "_c10d_functional.all_gather_into_tensor.default" in ops
        assert "_c10d_functional.wait_tensor.default" in ops
        want_reduce = 2 * (x0 + x1 + 200) + 1
        want_gather = torch.cat((x0 + 100, x1 + 100), 1)
        for key in ("traced", "inductor", "eager_of_other"):
            torch.testing.assert_close(r[key][0], want_reduce, msg=key)
            torch.testing.assert_close(r[key][1], want_gather, msg=key)


def test_world_of_one_collectives_are_the_input_itself() -> None:
    assert not torch.distributed.is_initialized()
    group = ps.get_tp_group()
    assert (group.rank, group.world_size, group.device_group) == (0, 1, None)
    x = torch.randn(3, 4)
    assert ps.tensor_model_parallel_all_reduce(x) is x
    assert ps.tensor_model_parallel_all_gather(x, 0) is x
    assert group.broadcast(x) is x
    assert group.broadcast_object("obj") == "obj"
    gm = make_fx(lambda t: ps.tensor_model_parallel_all_reduce(t) + 1)(x)
    assert not any("c10d" in str(n.target) for n in gm.graph.nodes)


def test_init_at_world_size_one_makes_no_process_group() -> None:
    ps.init_distributed_environment(1, 0, "tcp://127.0.0.1:1", "gloo")
    try:
        assert ps.get_tensor_model_parallel_world_size() == 1
        assert not torch.distributed.is_initialized()
    finally:
        ps.destroy_distributed_environment()


def _raise_on_rank_one() -> None:
    if ps.get_tensor_model_parallel_rank() == 1:
        raise KeyError("the bad rank")


def _die_on_rank_one() -> None:
    if ps.get_tensor_model_parallel_rank() == 1:
        os._exit(3)


def test_a_rank_that_raises_is_reraised_with_rank_and_traceback() -> None:
    with pytest.raises(RankFailedError, match=r"(?s)rank 1 raised.*Traceback.*KeyError.*bad rank"):
        run_on_ranks(_raise_on_rank_one, 2, timeout_s=60)


def test_a_rank_that_dies_is_reported_with_its_exit_code() -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) died: exit code 3"):
        run_on_ranks(_die_on_rank_one, 2, timeout_s=60)
