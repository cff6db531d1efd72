"""benchmarks/gpu_check.py and gpu_profile.py stay runnable between GPU sessions: they
run on the CPU with tiny shapes (--smoke) from a bare checkout (PYTHONPATH only), and
without a GPU their plain runs refuse in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


PROFILE = ROOT / "benchmarks" / "gpu_profile.py"


def _run(*args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the plain run would run")
def test_without_a_gpu_it_refuses_in_one_line(tmp_path: Path) -> None:
    proc = _run("--out-dir", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_every_row_runs_in_the_smoke_run(tmp_path: Path) -> None:
    proc = _run("--smoke", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    names = list(rows)
    # The decisive rows first: eager against the full decode graph at batch 1.
    assert names[:2] == ["1b CPU_TORCH:NONE b1 ctx16", "1b CPU_TORCH:FULL_DECODE_ONLY b1 ctx16"]
    assert not [n for n, r in rows.items() if "error" in r or "skipped" in r]
    tiny = {n: r for n, r in rows.items() if n.startswith("tiny fp32")}
    assert len(tiny) == 5 and all(r["ok"] for r in tiny.values())
    assert tiny["tiny fp32 CPU_TORCH:FULL"]["steps_by_mode"].get("mixed:FULL")
    assert rows["1b CPU_TORCH:FULL_DECODE_ONLY b1 ctx16"]["steps_by_mode"] == {"decode:FULL": 5}
    for name in ("1b CPU_TORCH:FULL_DECODE_ONLY b1 ctx16", "1b CPU_TORCH:PIECEWISE b1 ctx16"):
        assert rows[name]["logprobs_close"] is True
    assert {"step_ms", "forward_ms", "floor_ms"} <= set(rows["1b CPU_TORCH:NONE b2 ctx64"])
    assert "capture_s" in rows["1b FULL_DECODE_ONLY default capture sizes"]


def test_a_row_past_the_budget_is_recorded_as_skipped(tmp_path: Path) -> None:
    proc = _run("--smoke", "--out-dir", str(tmp_path), "--budget-s", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert rows and all("skipped" in r for r in rows.values())


def test_the_profile_runs_in_the_smoke_run_and_refuses_without_a_gpu(tmp_path: Path) -> None:
    proc = _run("--smoke", "--out-dir", str(tmp_path), script=PROFILE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_profile.json").read_text())
    assert report["full_graph"]["replay_ms"] > 0 and report["none_step_ms"] > 0
    assert {p["weight"].rsplit(".", 2)[-2] for p in report["projections"]} >= {
        "qkv_proj",
        "down_proj",
    }
    for table in ("kernels", "eager_host", "eager_ops"):
        assert (tmp_path / f"gpu_profile_{table}.txt").read_text().strip()
    if not torch.cuda.is_available():
        proc = _run("--out-dir", str(tmp_path / "plain"), script=PROFILE)
        assert proc.returncode == 2 and "no CUDA device" in proc.stderr
