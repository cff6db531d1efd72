"""benchmarks/bench_decode.py and its peers at tiny settings, so that the script's code
paths keep working: every side's two workloads, the bandwidth floor, the mid-size
checkpoint, the table and the JSON. Peers that are absent here are skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import peers  # noqa: E402

# Qwen2.5-0.5B's layout (grouped KV heads, tied embeddings, QKV biases), small enough to
# load in a second.
TINY_MID = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


def test_decode_bytes_count_the_lm_head_once_and_the_kv_of_every_layer(tmp_path: Path) -> None:
    path = peers.make_mid_checkpoint(tmp_path / "mid", torch.bfloat16, **TINY_MID)
    need = peers.decode_bytes(path, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path)
    # Tied: the embedding is the LM head, which parameters() yields once.
    numel = sum(p.numel() for p in model.parameters())
    assert need.weight_bytes == 2 * numel
    assert need.kv_bytes_per_position == 2 * 2 * 2 * (64 // 4) * 2  # K+V, layers, heads, dim
    # Twice the bandwidth, twice the floor; a longer context lowers it.
    assert need.floor_tokens_per_s(20.0, 1, 8) == pytest.approx(
        2 * need.floor_tokens_per_s(10.0, 1, 8)
    )
    assert need.floor_tokens_per_s(10.0, 4, 64) < need.floor_tokens_per_s(10.0, 4, 8)


def test_bandwidth_is_measured_and_positive() -> None:
    bw = peers.measure_bandwidth(mib=16, repeats=2)
    assert bw.read_gbs > 0 and bw.copy_gbs > 0 and bw.gemv_gbs > 0
    assert bw.floor_gbs == max(bw.read_gbs, bw.copy_gbs, bw.gemv_gbs)


def _run_both_workloads(side: peers.TransformersSide | peers.CTranslate2Side) -> None:
    assert side.batch1(4) > 0
    assert side.batched([[1, 30], [1, 40]], 3) > 0


def test_transformers_and_ctranslate2_run_both_workloads_on_the_mid_layout(
    tmp_path: Path,
) -> None:
    path = peers.make_mid_checkpoint(tmp_path / "mid", torch.float32, **TINY_MID)
    _run_both_workloads(peers.TransformersSide(path, torch.float32))
    try:
        side = peers.CTranslate2Side(path, torch.float32, 1, tmp_path)
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))
    _run_both_workloads(side)


def test_ctranslate2_refuses_a_compute_type_it_lacks_with_the_reason(tmp_path: Path) -> None:
    ct2 = pytest.importorskip("ctranslate2")
    if "bfloat16" in ct2.get_supported_compute_types("cpu"):
        pytest.skip("this CPU's CTranslate2 has bf16")
    path = peers.make_mid_checkpoint(tmp_path / "mid", torch.bfloat16, **TINY_MID)
    with pytest.raises(peers.PeerUnavailable, match="no bfloat16 compute type"):
        peers.CTranslate2Side(path, torch.bfloat16, 1, tmp_path)


def test_llama2c_builds_and_reports_tokens_per_s(tmp_path: Path) -> None:
    try:
        side = peers.Llama2cSide(tmp_path)
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))
    assert side.batch1(64) > 0  # enough milliseconds for its timer
    assert side.batched([[1, 30]], 4) is None


def test_script_prints_every_side_and_saves_floor_fractions(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--modes", "NONE",
           "--no-inductor", "--tokens", "64", "--repeats", "1", "--num-requests", "2",
           "--batch-tokens", "4", "--throughput-repeats", "1", "--num-scheduler-steps", "1",
           "4", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["models"]["stories260K"]["rows"]
    assert result["bandwidth_gbs"]["floor"] > 0
    skipped = rows.get("_skipped", {})
    for side in ("NONE", "NONE x4", "ctranslate2", "llama2.c", "transformers"):
        if side in skipped:
            continue
        assert rows[side]["batch1_tokens_per_s"] > 0
        assert rows[side]["batch1_floor_fraction"] > 0
        assert side in run.stdout
    if "ctranslate2" not in skipped:
        assert rows["NONE"]["batched_x_ctranslate2"] > 0
