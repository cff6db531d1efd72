"""Each backend's workspace: what it declares is what it allocates, and the KV cache
budget reserves exactly that (issue 12: the budget once reserved a gather workspace
for backends that never allocate one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decodegraph.attention.backends.base import AttentionBackend
from decodegraph.attention.backends.torch_paged import (
    CPUAttentionBackend,
    CUDATorchAttentionBackend,
)
from decodegraph.core.kv_cache_utils import kv_cache_block_counts
from decodegraph.entrypoints.llm import LLM
from decodegraph.platforms.cpu import CpuPlatform

# Llama-3.2-1B's attention at vLLM's default settings: 32 query heads, 8 KV heads of 64,
# blocks of 16, max_model_len 131072, 256 sequences.
LLAMA_1B = dict(num_heads=32, num_kv_heads=8, head_size=64, block_size=16, max_model_len=131072)
GiB = 2**30


def _backend(cls: type[AttentionBackend], **shape: int) -> AttentionBackend:
    s = {**LLAMA_1B, **shape}
    return cls(
        s["num_heads"],
        s["num_kv_heads"],
        s["head_size"],
        s["head_size"] ** -0.5,
        s["block_size"],
        s["max_model_len"],
    )


def _allocated(backend: AttentionBackend, max_num_reqs: int, dtype: torch.dtype) -> int:
    """Bytes of the workspace tensors allocate_workspace made."""
    shape = backend.get_kv_cache_shape(
        4, backend.block_size, backend.num_kv_heads, backend.head_size
    )
    backend.bind_kv_caches([(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))])
    before = {id(v) for v in vars(backend).values()}
    backend.allocate_workspace(max_num_reqs, dtype, torch.device("cpu"))
    return sum(
        v.nbytes
        for v in vars(backend).values()
        if isinstance(v, torch.Tensor) and id(v) not in before
    )


def test_cuda_torch_gathers_every_context_at_full_length() -> None:
    """The torch-op CUDA fallback really gathers max_num_reqs contexts of max_model_len
    (K and V), so at default settings it declares all of it: 64 GiB for the 1B shape."""
    backend = _backend(CUDATorchAttentionBackend)
    gathers = 2 * 256 * (131072 // 16) * 16 * 8 * 64 * 2
    positions = 131072 * 8
    assert gathers == 64 * GiB
    assert backend.workspace_bytes(256, torch.bfloat16) == gathers + positions


def test_the_native_cpu_operator_needs_only_its_score_rows(cpu_ops: object) -> None:
    """With the native operator (float32 and bfloat16 caches) nothing is gathered: the
    workspace is one score row per thread, independent of max_num_seqs."""
    backend = _backend(CPUAttentionBackend)
    declared = backend.workspace_bytes(256, torch.bfloat16)
    group = 32 // 8
    per_thread = (group * (131072 // 16) + 64 + 1) * 16 * 4
    assert declared == torch.get_num_threads() * per_thread
    assert declared == backend.workspace_bytes(1, torch.bfloat16)
    assert declared < GiB // 8


@pytest.mark.parametrize(
    "cls, dtype",
    [
        (CUDATorchAttentionBackend, torch.float32),
        (CUDATorchAttentionBackend, torch.bfloat16),
        (CPUAttentionBackend, torch.float32),
        (CPUAttentionBackend, torch.float16),  # no native operator: gathers
    ],
    ids=str,
)
def test_a_backend_allocates_exactly_what_it_declares(
    cls: type[AttentionBackend], dtype: torch.dtype
) -> None:
    backend = _backend(cls, max_model_len=256, num_heads=4, num_kv_heads=2)
    declared = backend.workspace_bytes(8, dtype)
    assert declared > 0
    assert _allocated(backend, 8, dtype) == declared


def test_the_kv_budget_reserves_exactly_the_declared_workspace(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = 64 * 2**20
    monkeypatch.setattr(CpuPlatform, "available_kv_cache_memory", lambda self, u, b, n=1: budget)
    llm = LLM(str(stories_dir), enforce_eager=True, max_model_len=256, max_num_seqs=8)
    runner = llm.llm_engine.runner
    reserved = runner.workspace_bytes()
    backend = runner.attn_backend
    assert reserved == backend.workspace_bytes(8, runner.dtype) > 0
    groups = runner.kv_cache_groups
    expected = kv_cache_block_counts(
        groups,
        [runner.kv_cache_bytes_per_block(g) for g in range(len(groups))],
        budget - reserved,
        runner.max_num_reqs,
        runner.max_num_tokens,
        256,
    )
    assert runner.num_blocks_per_group == expected
