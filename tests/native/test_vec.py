"""vec.h's helpers, compiled into a small program per vector ISA this machine runs (the
kernels' own flags): sum_lanes, the transposed reduction the attention kernels finish
with, gives each vector's lane sum with the bits of `sum` (at::vec's vec_reduce_all) on
the x86 vector ISAs. The portable loops' sums are plain loops that -ffast-math lets the
compiler reorder wherever they are inlined, so there they agree to rounding only."""

from __future__ import annotations

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


@pytest.mark.skipif(not shutil.which(get_cxx_compiler()), reason="no C++ compiler")
@pytest.mark.parametrize("isa", native.available_isas())
def test_sum_lanes_gives_the_lane_sum_of_each_vector(isa: str, tmp_path: Path) -> None:
    torch_dir = Path(torch.__file__).parent
    source, program = tmp_path / "sum_lanes.cpp", tmp_path / "sum_lanes"
    source.write_text(_PROGRAM)
    flags = native._flag_sets(isa)[1]  # the ISA's own flags, without OpenMP
    cmd = [
        get_cxx_compiler(),  # $CXX, else c++: the compiler that builds the operators
        "-std=c++17",
        *flags,
        "-I",
        str(native._CSRC),
        "-isystem",
        str(torch_dir / "include"),
        str(source),
        "-o",
        str(program),
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    out = subprocess.run([str(program)], capture_output=True, text=True, timeout=60)
    built_for, trials, bad, far = out.stdout.split()
    assert built_for == isa and int(trials) > 0
    assert int(far) == 0, out.stdout
    if isa != "scalar":
        assert int(bad) == 0, out.stdout
