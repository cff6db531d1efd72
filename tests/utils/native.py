"""Helpers for tests of the CPU operators' builds for each vector ISA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The tests that check the native operators against their references: every one of them
# runs again in a child process per narrower ISA (tests/native/test_isa_variants.py). The
# tests of how Inductor's graphs call the operators (their C shims, opaque operators: the
# same forwarding code for every ISA, compared with an eager call of the same build) run
# in the main process alone.
KERNEL_TESTS = (
    "tests/attention/test_torch_paged.py",
    "tests/layers/test_activation.py",
    "tests/layers/test_layernorm.py",
    "tests/layers/test_rotary_embedding.py",
    "tests/native/test_cpu_ops.py",
)
KERNEL_SELECTOR = (
    "(native or operator or large_step or softmax_weights) and not refuses and not loading"
    " and not inductor_graph and not shim"
)


def start_pytest_with_isa(
    isa: str, files: tuple[str, ...], selector: str, log: Path
) -> subprocess.Popen:
    """Start the tests of `files` matching `-k selector` in a child process whose
    operators are built for `isa` (DECODEGRAPH_CPU_ISA: a build is chosen once per
    process), its output going to `log`."""
    env = dict(os.environ, DECODEGRAPH_CPU_ISA=isa)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    cmd += ["-k", selector]
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)


def outputs_under_settings(script: str, var: str, tmp_path: Path) -> list:
    """Run `script` (`python -c`; it torch.saves its result to sys.argv[1]) in a child
    process with the environment variable `var` at "0", then at "1" (an operator reads
    such a switch once per process): the two results, loaded."""
    import torch

    outs = []
    for setting in ("0", "1"):
        path = tmp_path / f"{var.lower()}_{setting}.pt"
        proc = subprocess.run(
            [sys.executable, "-c", script, str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, var: setting},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(torch.load(path))
    return outs
