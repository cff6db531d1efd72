"""benchmarks/bench_attention.py end to end: two trees' kernels built and loaded side by
side in one process, on the same inputs (a tree against a copy of itself gives the same
bits), with the blocks in random and in lockstep order, and its JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from decodegraph import native

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not shutil.which("g++"), reason="no C++ compiler")
@pytest.mark.parametrize("lockstep", [False, True])
def test_a_tree_against_a_copy_of_itself_gives_the_same_bits(
    tmp_path: Path, lockstep: bool
) -> None:
    base = tmp_path / "base"
    shutil.copytree(ROOT / "decodegraph" / "native" / "csrc", base / "decodegraph/native/csrc")
    out = tmp_path / "attention.json"
    isa = native.available_isas()[0]
    cases = ["stories260K b16 ctx112 (L2)", "0.5B b1 ctx1024"]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_attention.py"),
         "--base-tree", str(base), "--isas", isa, "--cases", *cases,
         "--rounds", "2", "--budget-ms", "1", "--out", str(out),
         *(["--lockstep"] if lockstep else [])],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "attention"
    assert result["lockstep"] is lockstep
    rows = result["isas"][isa]["cases"]
    assert list(rows) == cases
    for case in cases:
        assert rows[case]["same_bits"] is True
        assert all(len(rounds) == 2 for rounds in rows[case]["rounds_us"].values())
        assert all(us > 0 for us in rows[case]["us"].values())
    assert f"{isa}: microseconds per step" in run.stdout
