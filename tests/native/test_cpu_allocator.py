"""The caching CPU allocator (csrc/cpu_allocator.h): a freed tensor's block serves the
next request of its size class, tensors read and write as ever, large requests and
blocks past the cap go back to the system when freed, blocks freed through c10's raw
interface come back, and a block freed on another thread is taken back like any other. Install and uninstall change the whole process, so they run
in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from decodegraph import native


@pytest.fixture
def allocator(cpu_ops: object) -> object:
    """The allocator installed with its default cap; the cap it had is put back after."""
    before = cpu_ops.cpu_allocator_stats()
    cpu_ops.cpu_allocator_install(64 << 20)
    yield cpu_ops
    if not before[0]:
        cpu_ops.cpu_allocator_install(0)


def _stats(ops: object) -> dict[str, int]:
    installed, cached, hits, misses, passed = ops.cpu_allocator_stats()
    return {
        "installed": installed,
        "cached": cached,
        "hits": hits,
        "misses": misses,
        "passed": passed,
    }


def test_a_freed_block_serves_the_next_request_of_its_size_class(allocator: object) -> None:
    a = torch.empty(300)  # 1200 bytes: the class of 1280
    address = a.data_ptr()
    del a
    before = _stats(allocator)
    b = torch.empty(310)  # 1240 bytes: the same class
    after = _stats(allocator)
    assert b.data_ptr() == address
    assert after["hits"] == before["hits"] + 1
    assert after["cached"] == before["cached"] - 1280
    assert b.data_ptr() % 64 == 0


def test_tensors_from_cached_blocks_hold_their_values(allocator: object) -> None:
    gen = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 255, 256, 257, 1000, 4096, 100_000, 1_000_000):
        x = torch.randn(n, generator=gen)
        y = x.clone()
        del x
        z = torch.zeros(n)  # a reused block, zeroed by the op, not by the allocator
        assert torch.count_nonzero(z) == 0
        z.copy_(y)
        assert torch.equal(z, y)
        assert z.data_ptr() % 64 == 0


def test_a_request_above_the_largest_class_is_never_cached(allocator: object) -> None:
    before = _stats(allocator)
    big = torch.ones(2 << 20)  # 8 MiB
    del big
    after = _stats(allocator)
    assert after["passed"] == before["passed"] + 1
    assert after["cached"] == before["cached"]


def test_an_empty_tensor_has_no_block(allocator: object) -> None:
    before = _stats(allocator)
    empty = torch.empty(0)
    assert _stats(allocator)["passed"] == before["passed"] + 1
    assert empty.data_ptr() == 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_blocks_allocated_and_freed_through_the_raw_interface_come_back(cpu_ops: object) -> None:
    """torch's oneDNN integration allocates its buffers with c10's raw_allocate and frees
    them with raw_deallocate, which calls the allocator's raw deleter on the bare pointer:
    an empty one (a reorder's scratchpad), a small and a large one. The deleter crashed
    the process on blocks it had left to c10 (an empty or a large request; on aarch64 every
    float32 mm over 8 rows goes through oneDNN), so this runs in a child."""
    code = (
        "import torch\n"
        "from decodegraph import native\n"
        "assert native.install_cpu_allocator()\n"
        "for shape in ((16, 16), (2048, 1024)):\n"  # 1 KiB; 8 MiB, past the largest class
        "    x = torch.randn(*shape)\n"
        "    assert torch.equal(x.to_mkldnn().to_dense(), x)\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_no_more_than_the_cap_is_kept(allocator: object) -> None:
    allocator.cpu_allocator_trim()
    allocator.cpu_allocator_install(1 << 20)
    try:
        blocks = [torch.empty(256 << 10 >> 2) for _ in range(8)]  # 8 x 256 KiB
        del blocks
        assert 0 < _stats(allocator)["cached"] <= 1 << 20
    finally:
        allocator.cpu_allocator_install(64 << 20)


def test_a_block_freed_on_another_thread_is_taken_back(allocator: object) -> None:
    allocator.cpu_allocator_trim()
    made = [torch.empty(5000) for _ in range(4)]
    addresses = {t.data_ptr() for t in made}

    def drop() -> None:
        made.clear()

    t = threading.Thread(target=drop)
    t.start()
    t.join()
    again = [torch.empty(5000) for _ in range(4)]
    assert {x.data_ptr() for x in again} == addresses


def test_trim_frees_every_cached_block(allocator: object) -> None:
    x = [torch.empty(n) for n in (10, 1000, 100_000)]
    del x
    assert _stats(allocator)["cached"] > 0
    allocator.cpu_allocator_trim()
    assert _stats(allocator)["cached"] == 0


def test_the_cpu_platform_installs_it_and_zero_megabytes_leaves_it_out(cpu_ops: object) -> None:
    code = (
        "import os, torch\n"
        "from decodegraph.platforms.cpu import CpuPlatform\n"
        "ops = torch.ops.decodegraph_cpu\n"
        "CpuPlatform().configure_process()\n"
        "print(ops.cpu_allocator_stats()[0])\n"
        "x = torch.empty(1000); del x\n"
        "ops.cpu_allocator_install(0)\n"  # out again: the tensors it made still free
        "y = torch.empty(1000); del y\n"
        "print(ops.cpu_allocator_stats()[0], ops.cpu_allocator_stats()[1])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split("\n")
    assert out[0] == "1"
    assert out[1] == "0 0"
    off = subprocess.run(
        [sys.executable, "-c", code.split("x = ")[0]],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={**os.environ, "DECODEGRAPH_CPU_ALLOCATOR_CACHE_MB": "0"},
    ).stdout
    assert off.strip() == "0"


def test_a_bad_cache_size_names_the_variable(
    cpu_ops: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    for bad in ("-1", "lots", "1.5"):
        monkeypatch.setenv("DECODEGRAPH_CPU_ALLOCATOR_CACHE_MB", bad)
        with pytest.raises(ValueError, match="DECODEGRAPH_CPU_ALLOCATOR_CACHE_MB"):
            native.install_cpu_allocator()
