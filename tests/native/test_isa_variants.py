"""Every vector ISA this machine runs, against the references: the main process tests the
best build; each narrower one (AVX2 on an AVX-512 machine, the portable loops on x86) runs
the kernel tests again in a child process with its own build (cached like the first)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decodegraph import native
from tests.utils.native import KERNEL_SELECTOR, KERNEL_TESTS, start_pytest_with_isa


def test_the_operators_are_built_for_the_requested_isa(cpu_ops: object) -> None:
    wanted = os.environ.get("DECODEGRAPH_CPU_ISA") or native.available_isas()[0]
    assert native.cpu_isa() == wanted
    assert cpu_ops.vector_isa() == wanted


def test_the_best_isa_comes_first_and_the_portable_one_last_on_x86() -> None:
    isas = native.available_isas()
    assert isas in (["avx512", "avx2", "scalar"], ["avx2", "scalar"], ["scalar"], ["neon"])


def test_an_isa_this_machine_cannot_run_falls_back_to_the_best(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DECODEGRAPH_CPU_ISA", "sve")
    assert native._isa() == native.available_isas()[0]
    assert "DECODEGRAPH_CPU_ISA=sve" in caplog.text


def test_each_isa_builds_with_its_at_vec_capability_macro() -> None:
    flags = {isa: " ".join(native._flag_sets(isa)[0]) for isa in native._ISA_FLAGS}
    assert "-DCPU_CAPABILITY_AVX512" in flags["avx512"] and "-march=native" in flags["avx512"]
    assert "-DCPU_CAPABILITY_AVX2" in flags["avx2"] and "-mno-avx512f" in flags["avx2"]
    assert "CPU_CAPABILITY_AVX" not in flags["scalar"] and "-march" not in flags["scalar"]
    assert all("-ffp-contract=off" in f for f in flags.values())


NARROWER = [isa for isa in native.available_isas()[1:] if not os.environ.get("DECODEGRAPH_CPU_ISA")]


@pytest.fixture(scope="module")
def narrower_isa_runs(
    cpu_ops: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """Every narrower ISA's child, all started at once: each first builds its operators
    (one compiler process), so the builds run side by side on the machine's cores."""
    files = (*KERNEL_TESTS, "tests/native/test_isa_variants.py")
    logs = tmp_path_factory.mktemp("isa_runs")
    runs = {}
    for isa in NARROWER:
        log = logs / f"{isa}.log"
        runs[isa] = (
            start_pytest_with_isa(isa, files, f"{KERNEL_SELECTOR} or requested_isa", log),
            log,
        )
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("isa", NARROWER)
def test_the_kernels_match_their_references_on_a_narrower_isa(
    narrower_isa_runs: dict[str, tuple[subprocess.Popen, Path]], isa: str
) -> None:
    proc, log = narrower_isa_runs[isa]
    returncode = proc.wait(timeout=900)
    output = log.read_text()
    assert returncode == 0, output[-4000:]
    assert " passed" in output and " failed" not in output


_ARM_UNIT = """
#include "activation.h"
#include "linear.h"
#include "paged_attention.h"
#include "rms_norm.h"
#include "rotary_embedding.h"
void touch(float* o, const float* x, const float* w, const decodegraph::paged_attention_step* a,
           float* work, uint16_t* o16, const uint16_t* w16) {
    decodegraph::silu_and_mul_f32(o, x, 2, 64, 128);
    decodegraph::linear_one_row_f32(o, x, w, w, 0, 7, 64);
    decodegraph::widen_bf16_pairs(o, w16, 64);
    decodegraph::linear_one_row_bf16(o16, x, w16, w16, 0, 7, 64);
    decodegraph::rms_norm_f32(o, x, w, 2, 64, 64, 1e-5f);
    decodegraph::fused_add_rms_norm_f32(o, o, x, x, w, 2, 64, 64, 64, 1e-5f);
    decodegraph::rotary_embedding_f32(o, x, w, w, 2, 4, 8, 32, 8, 8);
    decodegraph::paged_attention_begin(a);
    decodegraph::paged_attention_requests(a, 0, 1, work);
}
"""


@pytest.mark.skipif(not shutil.which("aarch64-linux-gnu-g++"), reason="no aarch64 cross compiler")
def test_the_kernels_compile_to_neon_with_the_fpcr_flush_for_aarch64(tmp_path: Path) -> None:
    """Where a cross compiler is at hand (apt's g++-aarch64-linux-gnu): the kernels (not
    the torch registration, which needs an aarch64 libtorch) compile for ARM, with NEON
    multiply-adds, bf16 widened by NEON shifts, and the FPCR.FZ flush."""
    unit, obj = tmp_path / "unit.cpp", tmp_path / "unit.o"
    unit.write_text(_ARM_UNIT)
    include = Path(torch.__file__).parent / "include"
    flags = [*native._BASE_FLAGS, "-march=armv8.2-a", "-DCPU_CAPABILITY=dg_neon", "-std=c++20"]
    cmd = ["aarch64-linux-gnu-g++", *flags, "-I", str(native._CSRC), "-isystem", str(include)]
    subprocess.run([*cmd, "-c", str(unit), "-o", str(obj)], check=True, timeout=300)
    asm = subprocess.run(
        ["aarch64-linux-gnu-objdump", "-d", str(obj)], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"fmla\s+v\d+\.4s", asm), "no NEON multiply-add"
    assert re.search(r"shl\s+v\d+\.4s, v\d+\.4s, #16", asm), "no bf16 widening by shifts"
    assert re.search(r"msr\s+fpcr", asm), "no FPCR write"
