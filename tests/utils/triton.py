"""Running a test module's Triton cases in the interpreter, in a child pytest.

`triton.jit` decides at decoration time whether a kernel runs compiled or interpreted, so
a module whose kernels are checked on the CPU defines its cases only where
TRITON_INTERPRET=1, and in the normal run one test that starts that child. On CPU machines
triton is not in the venv but in the repository's .triton/ (`make setup`,
requirements-triton.txt), which only the child gets on its PYTHONPATH."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DIR = Path(__file__).resolve().parents[2] / ".triton"


NO_TRITON = "triton is neither installed nor in .triton/ (run `make setup`)"


def triton_findable() -> bool:
    """Whether a child process can import triton: installed, or in .triton/."""
    return importlib.util.find_spec("triton") is not None or (TRITON_DIR / "triton").is_dir()


def env_with_triton(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra`, for a child that imports triton and
    decodegraph: the repository first on its PYTHONPATH, then .triton/ where triton is
    not installed."""
    env = dict(os.environ, **extra)
    paths = [str(TRITON_DIR.parent), env.get("PYTHONPATH", "")]
    if importlib.util.find_spec("triton") is None:  # the CPU setup's copy, for tests only
        paths.insert(1, str(TRITON_DIR))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def run_interpreted(test_file: str, timeout: float = 900) -> None:
    """Run `test_file`'s pytest cases with TRITON_INTERPRET=1 in a child process; fail
    unless they all pass (none skipped), skip where triton is nowhere to be found."""
    if not triton_findable():
        pytest.skip(NO_TRITON)
    env = env_with_triton(TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]
