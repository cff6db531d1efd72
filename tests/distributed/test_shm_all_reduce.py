"""The shared-memory all-reduce of two ranks on one host: bit for bit gloo's, eager, traced
and in Inductor-compiled CPU graphs (Python and C++ wrappers), over many calls; gloo for
what does not fit; a peer that is gone fails the call naming it; nothing left in
/dev/shm.

Two gloo ranks in spawned processes (tests/utils/distributed.py); each test is one spawn.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from decodegraph.distributed import parallel_state as ps
from decodegraph.distributed.shm_all_reduce import DEFAULT_SLOT_BYTES
from decodegraph.native import load_cpu_ops
from decodegraph.platforms.cpu_graph import CpuGraph
from tests.utils.distributed import run_on_ranks

pytestmark = pytest.mark.skipif(load_cpu_ops() is None, reason="no CPU operators built")

# Elements: one value, a decode row of Qwen2.5-0.5B, 32 of them, odd, and one more than
# a float32 slot holds (gloo then).
SIZES = (1, 896, 32 * 896, 1001, DEFAULT_SLOT_BYTES // 4 + 1)


def _input(rank: int, n: int, dtype: torch.dtype, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + n % 7)
    return torch.randn(n, generator=g).to(dtype)


def _gloo_all_reduce(x: torch.Tensor) -> torch.Tensor:
    group_name = ps.get_tp_group().group_name
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _reduce_gather(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = ps.tensor_model_parallel_all_reduce(x * 2)
    return ps.tensor_model_parallel_all_reduce(y + 1), ps.tensor_model_parallel_all_gather(x, 0)


def _shm_against_gloo() -> dict[str, object]:
    group = ps.get_tp_group()
    rank = group.rank
    out: dict[str, object] = {"segment_left": os.path.exists(f"/dev/shm{group.shm.name}")}
    mismatches = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            x = _input(rank, n, dtype).view(-1, 7) if n % 7 == 0 else _input(rank, n, dtype)
            if not torch.equal(ps.tensor_model_parallel_all_reduce(x), _gloo_all_reduce(x)):
                mismatches.append((str(dtype), n))
    out["mismatches"] = mismatches
    out["fits"] = [group.shm.applies(_input(rank, n, torch.float32)) for n in SIZES]
    # Many calls in a row (both slot parities, many times), each checked against the sum
    # computed here from both ranks' inputs; a non-contiguous input too.
    wrong = 0
    for step in range(500):
        x = _input(rank, 64 + step % 5, torch.float32, step)
        want = _input(0, 64 + step % 5, torch.float32, step) + _input(
            1, 64 + step % 5, torch.float32, step
        )
        wrong += not torch.equal(ps.tensor_model_parallel_all_reduce(x), want)
    out["wrong_of_500"] = wrong
    x = torch.arange(12.0).view(3, 4) + rank
    out["strided"] = ps.tensor_model_parallel_all_reduce(x.t())
    out["gather_last"] = ps.tensor_model_parallel_all_gather(x, -1)

    x = torch.arange(14.0).view(2, 7) + 10 * rank
    gm = make_fx(_reduce_gather)(x)
    out["traced_ops"] = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
    other = x + 100
    out["eager"] = _reduce_gather(other)
    out["traced"] = gm(other)
    for key, options in (("inductor", None), ("inductor_cpp_wrapper", {"cpp_wrapper": True})):
        buf = x.clone()
        graph = CpuGraph("shm", _reduce_gather, [buf], use_inductor=True, inductor_options=options)
        buf.copy_(other)
        out[key] = [[t.clone() for t in graph.replay()] for _ in range(3)]
    return out


def test_shm_all_reduce_is_gloo_bit_for_bit_eager_traced_and_compiled() -> None:
    results = run_on_ranks(_shm_against_gloo, 2)
    x0, x1 = (torch.arange(14.0).view(2, 7) + 10 * r + 100 for r in range(2))
    want = (2 * (2 * (x0 + x1)) + 2, torch.cat((x0, x1), 0))
    for r in results:
        assert not r["segment_left"]
        assert r["mismatches"] == []
        assert r["fits"] == [True, True, True, True, False]
        assert r["wrong_of_500"] == 0
        torch.testing.assert_close(r["strided"], (2 * torch.arange(12.0).view(3, 4) + 1).t())
        m = torch.arange(12.0).view(3, 4)
        torch.testing.assert_close(r["gather_last"], torch.cat((m, m + 1), 1))
        assert "decodegraph_cpu.shm_all_reduce.default" in r["traced_ops"]
        assert "decodegraph_cpu.shm_all_gather.default" in r["traced_ops"]
        assert not any("c10d" in op for op in r["traced_ops"])
        for key in ("eager", "traced"):
            torch.testing.assert_close(tuple(r[key]), want, msg=key, rtol=0, atol=0)
        for key in ("inductor", "inductor_cpp_wrapper"):
            for replay in r[key]:
                torch.testing.assert_close(tuple(replay), want, msg=key, rtol=0, atol=0)
    assert torch.equal(results[0]["traced"][0], results[1]["traced"][0])


def _call_after_the_peer_left() -> tuple[str, float] | None:
    x = torch.ones(8)
    ps.tensor_model_parallel_all_reduce(x)
    if ps.get_tensor_model_parallel_rank() == 1:
        return None  # this rank leaves: its process exits
    start = time.monotonic()
    try:
        ps.tensor_model_parallel_all_reduce(x)
    except RuntimeError as e:
        return str(e).splitlines()[0], time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_call_whose_peer_is_gone_raises_naming_it_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DECODEGRAPH_DIST_TIMEOUT_S", "1")
    message, waited = run_on_ranks(_call_after_the_peer_left, 2, timeout_s=60)[0]
    assert "rank 1 did not reach call 2 within 1 s" in message
    assert 1 <= waited < 10
