"""Lazy checkpoint slices: a weight loader narrows one to its rank's part, and only that
part is read from the safetensors file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from decodegraph.layers.linear import QKVParallelLinear, RowParallelLinear
from decodegraph.models.llama import get_num_heads_per_rank
from decodegraph.models.loader import iterate_safetensors
from decodegraph.models.weights import CheckpointSlice
from tests.utils.checkpoints import make_hf_config


@pytest.fixture
def table_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(48.0).view(6, 8), "s": torch.tensor(2.5)}, str(path))
    return path


def test_narrowed_slices_read_exactly_their_region(table_file: Path) -> None:
    full = torch.arange(48.0).view(6, 8)
    with safe_open(table_file, framework="pt") as f:
        lazy = CheckpointSlice.of(f.get_slice("w"))
        assert lazy.shape == (6, 8) and lazy.numel() == 48
        part = lazy.narrow(0, 2, 3).narrow(1, 4, 4).narrow(0, 1, 2)  # composes like a tensor
        assert part.shape == (2, 4)
        assert torch.equal(part.read(), full.narrow(0, 2, 3).narrow(1, 4, 4).narrow(0, 1, 2))
        assert torch.equal(lazy.narrow(-1, 7, 1).read(), full[:, 7:])
        assert CheckpointSlice.of(f.get_slice("s")).read().item() == 2.5  # 0-d
        with pytest.raises(ValueError, match=r"narrow\(0, 4, 3\) is outside.*\(6, 8\)"):
            lazy.narrow(0, 4, 3)


def test_iterate_safetensors_yields_slices_that_loaders_narrow(table_file: Path) -> None:
    full = torch.arange(48.0).view(6, 8)
    row = RowParallelLinear(8, 6, tp_rank=1, tp_size=2)
    qkv = QKVParallelLinear(8, 2, 1, 1, tp_rank=0, tp_size=1)  # q, k, v: 2 rows each
    for name, lazy in iterate_safetensors(table_file.parent):
        assert isinstance(lazy, CheckpointSlice)
        if name == "w":
            row.weight_loader(row.weight, lazy)
            qkv.weight_loader(qkv.weight, lazy.narrow(0, 0, 2), "k")
    assert torch.equal(row.weight.data, full[:, 4:])
    assert torch.equal(qkv.weight.data[2:4], full[:2])


def test_heads_per_rank_follow_the_config_and_name_tensor_parallel_size() -> None:
    config = make_hf_config("llama-gqa")  # 4 heads, 2 KV heads
    assert get_num_heads_per_rank(config, 1) == (4, 2)
    assert get_num_heads_per_rank(config, 2) == (2, 1)
    assert get_num_heads_per_rank(config, 4) == (1, 1)  # KV heads replicated
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide num_attention"):
        get_num_heads_per_rank(config, 3)
