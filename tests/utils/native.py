"""Helpers for tests of the CPU operators' portable paths."""

from __future__ import annotations

import os
import subprocess
import sys


def pytest_without_avx512(test_file: str, selector: str) -> subprocess.CompletedProcess:
    """Run the tests of `test_file` matching `-k selector` in a child process whose
    operators take their portable loops (DECODEGRAPH_CPU_NO_AVX512=1: the switch is read
    once per process)."""
    env = dict(os.environ, DECODEGRAPH_CPU_NO_AVX512="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    cmd += ["-k", selector]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
