"""The batch-1 projection's row order, measured by the CPU platform once its weights are
loaded (decodegraph/platforms/cpu_projection.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from decodegraph.layers.linear import ReplicatedLinear, one_row_linear
from decodegraph.platforms import cpu_projection
from decodegraph.platforms.cpu import CpuPlatform
from decodegraph.platforms.cpu_projection import (
    ENV,
    ONE_STREAM,
    SIDE_BY_SIDE,
    VENDOR_RULE,
    choose_projection_rows,
    first_bytes,
    projection_weights,
)


@pytest.fixture
def ops(cpu_ops: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The operators with no order set by the environment, the vendor rule put back after."""
    monkeypatch.delenv(ENV, raising=False)
    yield cpu_ops
    cpu_ops.set_rows_side_by_side(VENDOR_RULE)


class _Model(nn.Module):
    """Projections of `dtype` weights, one float16 one (the operator does not take it) and
    one too small for the operator, and an LM head read by the batch-1 product (as the
    models' `logits_one_row`)."""

    def __init__(self, layers: int = 3, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.lm_head = nn.Linear(256, 512, bias=False, dtype=dtype)
        self.layers = nn.ModuleList(ReplicatedLinear(256, 384).to(dtype) for _ in range(layers))
        self.fp16 = ReplicatedLinear(256, 384).to(torch.float16)
        self.small = ReplicatedLinear(16, 16)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()
        for module in self.modules():
            if isinstance(module, ReplicatedLinear):
                module.process_weights_after_loading()
        self.logits_one_row = one_row_linear(self.lm_head.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_weights_measured_are_the_projections_then_the_lm_head(
    ops: object, dtype: torch.dtype
) -> None:
    model = _Model(dtype=dtype)
    weights = projection_weights(model)
    assert [w.data_ptr() for w in weights] == [
        *(layer.weight.data_ptr() for layer in model.layers),
        model.lm_head.weight.data_ptr(),
    ]


def test_a_pass_takes_the_weights_in_order_up_to_its_bytes_cutting_the_last() -> None:
    a, b, c = torch.zeros(10, 100), torch.ones(10, 100), torch.ones(4, 100)
    taken = first_bytes([a, b, c], 6000)  # a is 4000 bytes, a row 400
    assert [t.shape[0] for t in taken] == [10, 5]
    assert taken[1].data_ptr() == b.data_ptr() and taken[1].is_contiguous()


@pytest.mark.parametrize(
    "one, side, expected",
    [(2.0, 1.0, SIDE_BY_SIDE), (1.0, 2.0, ONE_STREAM), (1.0, 1.01, VENDOR_RULE)],
    ids=["side-by-side-faster", "one-stream-faster", "level"],
)
def test_weights_beyond_the_cache_are_timed_both_ways_and_the_faster_order_kept(
    ops: object,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    one: float,
    side: float,
    expected: int,
) -> None:
    monkeypatch.setattr(cpu_projection, "last_level_cache_bytes", lambda: 64 << 10)
    monkeypatch.setattr(cpu_projection, "PASS_BYTES", 1 << 20)
    orders = []

    def time_pass(ops_: object, weights: list, inputs: dict) -> float:
        order = ops_.rows_side_by_side(256)
        orders.append(order)
        return side if order else one

    monkeypatch.setattr(cpu_projection, "time_pass", time_pass)
    with caplog.at_level(logging.INFO, logger=cpu_projection.__name__):
        assert choose_projection_rows(_Model()) == expected
    # One untimed pass per order, then ROUNDS timed passes each.
    assert orders.count(True) == orders.count(False) == cpu_projection.ROUNDS + 1
    if expected == VENDOR_RULE:
        assert ops.rows_side_by_side(256) is False  # no vendor reads such short rows apart
    else:
        assert ops.rows_side_by_side(256) is (expected == SIDE_BY_SIDE)
        assert ops.rows_side_by_side(5000) is (expected == SIDE_BY_SIDE)
    assert "one stream" in caplog.text and f"{ENV}=0/1" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_real_measurement_sets_an_order_and_changes_no_bits(
    ops: object, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Unpatched timings on weights made to outgrow a pretend cache: whichever order it
    keeps, every projection gives the bits it gave before."""
    monkeypatch.setattr(cpu_projection, "last_level_cache_bytes", lambda: 64 << 10)
    monkeypatch.setattr(cpu_projection, "PASS_BYTES", 1 << 20)
    model = _Model(dtype=dtype)
    x = torch.randn(1, 256, dtype=dtype)
    before = [layer(x) for layer in model.layers]
    choice = choose_projection_rows(model)
    assert choice in (ONE_STREAM, SIDE_BY_SIDE, VENDOR_RULE)
    if choice != VENDOR_RULE:
        assert ops.rows_side_by_side(256) is (choice == SIDE_BY_SIDE)
    for layer, want in zip(model.layers, before, strict=True):
        assert torch.equal(layer(x), want)


def test_either_order_gives_the_same_bits(ops: object) -> None:
    """Set in the process (as the measurement does), rows side by side and one stream
    sum every row in the same order, float32 and bfloat16 (with a bias): rows left over
    by the rows read at once, and values past the last whole vector, included."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in [(1001, 344), (257, 4865), (3, 896), (130, 70)]:
            x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
            bias = torch.randn(n, generator=gen).to(dtype) if dtype == torch.bfloat16 else None
            cases.append((x.to(dtype), w.to(dtype), bias))
    outs = {}
    for choice in (ONE_STREAM, SIDE_BY_SIDE):
        ops.set_rows_side_by_side(choice)
        assert ops.rows_side_by_side(896) is (choice == SIDE_BY_SIDE)
        assert ops.rows_side_by_side(896, True) is (choice == SIDE_BY_SIDE)
        outs[choice] = [ops.linear_one_row(x, w, b) for x, w, b in cases]
    for a, b in zip(outs[ONE_STREAM], outs[SIDE_BY_SIDE], strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="-1, 0 or 1"):
        ops.set_rows_side_by_side(2)


def test_weights_within_the_cache_are_not_measured(
    ops: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_projection, "last_level_cache_bytes", lambda: 32 << 20)
    monkeypatch.setattr(cpu_projection, "time_pass", pytest.fail)
    assert choose_projection_rows(_Model()) is None


@pytest.mark.parametrize("setting", ["0", "1"])
def test_the_environment_decides_instead_of_a_measurement(
    ops: object, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    monkeypatch.setenv(ENV, setting)
    monkeypatch.setattr(cpu_projection, "last_level_cache_bytes", lambda: 64 << 10)
    monkeypatch.setattr(cpu_projection, "time_pass", pytest.fail)
    assert choose_projection_rows(_Model()) is None


def test_the_last_level_cache_is_read_from_sysfs_or_assumed() -> None:
    size = cpu_projection.last_level_cache_bytes()
    caches = Path("/sys/devices/system/cpu/cpu0/cache")
    if not caches.is_dir():
        assert size == cpu_projection.DEFAULT_LLC_BYTES
    else:
        assert size >= 256 << 10  # at least an L2's size: the largest cache of the core


def test_loading_a_model_lets_the_platform_tune_for_its_weights(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from decodegraph.entrypoints.llm import LLM

    seen = []
    monkeypatch.setattr(CpuPlatform, "tune_for_weights", lambda self, model: seen.append(model))
    llm = LLM(str(stories_dir), enforce_eager=True)
    assert seen == [llm.llm_engine.runner.model]
    # Its loaded weights: the hook runs after loading and the layers' own hooks.
    assert seen[0].model.layers[0].mlp.down_proj.weight_t is not None
