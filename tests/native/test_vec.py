"""vec.h's helpers, compiled into a small program per vector ISA this machine runs (the
kernels' own flags):
- sum_lanes, the transposed reduction the attention kernels finish with, gives each
  vector's lane sum with the bits of `sum` (at::vec's vec_reduce_all) on the x86 vector
  ISAs. The portable loops' sums are plain loops that -ffast-math lets the compiler
  reorder wherever they are inlined, so there they agree to rounding only.
- flush_denormals sets the subnormal flush of this CPU (MXCSR.FTZ and DAZ on x86,
  FPCR.FZ on aarch64) and restore_fp_mode takes it off again, in scalar and vector
  arithmetic alike."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import get_cxx_compiler

from decodegraph import native

_PROGRAM = r"""
#include "vec.h"
#include <cstdio>
#include <cmath>
#include <cstring>
#include <random>
using namespace decodegraph;
int main() {
    std::mt19937 rng(7);
    // Magnitudes over many binades, so that every order of the additions rounds apart.
    std::uniform_real_distribution<float> mant(-1.f, 1.f);
    std::uniform_int_distribution<int> expo(-20, 20);
    int bad = 0, far = 0, trials = 0;
    for (int trial = 0; trial < 2000; trial++) {
        __at_align__ float raw[kLanes * kLanes];
        for (auto& x : raw)
            x = std::ldexp(mant(rng), expo(rng));
        Vec v[kLanes];
        for (int64_t k = 0; k < kLanes; k++)
            v[k] = Vec::loadu(raw + k * kLanes);
        for (int64_t n = 1; n <= kLanes; n++, trials++) {
            __at_align__ float got[kLanes];
            sum_lanes(v, n).store(got);
            for (int64_t k = 0; k < kLanes; k++) {
                const float want = k < n ? sum(v[k]) : 0.f;
                float size = 0.f;  // the sum of magnitudes: the rounding's scale
                for (int64_t i = 0; k < n && i < kLanes; i++)
                    size += std::fabs(raw[k * kLanes + i]);
                bad += std::memcmp(&got[k], &want, sizeof want) != 0;
                far += std::fabs(got[k] - want) > 1e-6f * size;
            }
        }
    }
    std::printf("%s %d %d %d\n", vector_isa(), trials, bad, far);
    return 0;
}
"""


_FLUSH_PROGRAM = r"""
#include "vec.h"
#include <cstdio>
#include <cstring>
using namespace decodegraph;
// Kept out of the compiler's reach, so that every product happens at run time.
volatile float tiny = 1e-20f, subnormal = 1e-40f;
static unsigned bits(float x) {  // printed as bits: a conversion to double would read x
    unsigned u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
static void products(const char* when) {
    const float a = tiny, s = subnormal;
    __at_align__ float lanes[kLanes];
    (Vec(a) * Vec(a)).store(lanes);
    // A product below the normal range (flush-to-zero), and a subnormal operand (read as
    // zero where the CPU flushes its inputs: x86's DAZ, ARM's FZ).
    std::printf("%s %u %u %u\n", when, bits(a * a), bits(lanes[kLanes - 1]), bits(s * 1e30f));
}
int main() {
    std::printf("%s\n", vector_isa());
    products("before");
    const uint64_t saved = flush_denormals();
    products("during");
    restore_fp_mode(saved);
    products("after");
    return 0;
}
"""


def _build_and_run(isa: str, program_text: str, tmp_path: Path) -> list[str]:
    """The lines a program prints, built with the kernels' flags for `isa`."""
    torch_dir = Path(torch.__file__).parent
    source, program = tmp_path / "program.cpp", tmp_path / "program"
    source.write_text(program_text)
    flags = native._flag_sets(isa)[1]  # the ISA's own flags, without OpenMP
    compiler = get_cxx_compiler()  # $CXX, else c++: the compiler that builds the operators
    include = ["-I", str(native._CSRC), "-isystem", str(torch_dir / "include")]
    compile_cmd = [
        compiler,
        "-std=c++17",
        *flags,
        *include,
        "-c",
        str(source),
        "-o",
        f"{program}.o",
    ]
    # Linked apart, without the flags: a link with -ffast-math adds the start-up code that
    # switches the whole program to flush-to-zero (the operators' library is not linked so).
    lib = torch_dir / "lib"
    link_cmd = [
        compiler,
        f"{program}.o",
        "-o",
        str(program),
        f"-L{lib}",
        "-lc10",
        f"-Wl,-rpath,{lib}",
    ]
    for cmd in (compile_cmd, link_cmd):
        subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    out = subprocess.run([str(program)], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines()


needs_compiler = pytest.mark.skipif(not shutil.which(get_cxx_compiler()), reason="no C++ compiler")


@needs_compiler
@pytest.mark.parametrize("isa", native.available_isas())
def test_sum_lanes_gives_the_lane_sum_of_each_vector(isa: str, tmp_path: Path) -> None:
    (line,) = _build_and_run(isa, _PROGRAM, tmp_path)
    built_for, trials, bad, far = line.split()
    assert built_for == isa and int(trials) > 0
    assert int(far) == 0, line
    if isa != "scalar":
        assert int(bad) == 0, line


@needs_compiler
@pytest.mark.parametrize("isa", native.available_isas())
def test_flush_denormals_flushes_until_the_mode_is_restored(isa: str, tmp_path: Path) -> None:
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        pytest.skip(f"flush_denormals sets no mode on {platform.machine()}")
    built_for, *lines = _build_and_run(isa, _FLUSH_PROGRAM, tmp_path)
    assert built_for == isa
    values = {when: [int(v) for v in rest] for when, *rest in map(str.split, lines)}
    assert all(v != 0 for v in values["before"]), lines
    assert values["during"] == [0, 0, 0], lines
    assert values["after"] == values["before"], lines
