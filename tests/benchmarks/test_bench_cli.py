"""`decodegraph bench latency|throughput|serve` end to end: the table, the JSON (one
entry per graph mode, or per request rate) and a PNG that decodes."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from decodegraph.benchmarks.common import add_offline_args, offline_sampling_params
from decodegraph.entrypoints.cli import main
from tests.utils.server import RunningServer, make_engine, start_server

# Few iterations, small batches, no Inductor: seconds, not minutes.
FAST = ["--log-level", "WARNING"]
NO_INDUCTOR = ["-O", '{"use_inductor": false, "cudagraph_capture_sizes": [1, 2, 4]}']
MODES = ["NONE", "PIECEWISE", "FULL_DECODE_ONLY"]


def _png(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        image.load()  # decodes every pixel: a truncated file fails here
        return image.size


def test_bench_latency_writes_one_entry_per_mode_and_a_line_per_mode_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "latency.json", tmp_path / "latency.png"
    code = main(
        [*FAST, "bench", "latency", *NO_INDUCTOR, "--batch-size", "1", "4",
         "--input-len", "8", "--output-len", "16", "--num-iters-warmup", "1", "--num-iters", "3",
         "--graph-modes", *MODES, "--output-json", str(out), "--plot", str(png)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "latency" and list(result["results"]) == MODES
    for mode in MODES:
        row = result["results"][mode]
        assert row["resolved_mode"] == mode and set(row["batch_sizes"]) == {"1", "4"}
        for size, cell in row["batch_sizes"].items():
            assert len(cell["latencies"]) == 3 and cell["avg_latency"] > 0
            median = cell["percentiles"]["50"]
            assert cell["output_tokens_per_s"] == pytest.approx(int(size) * 16 / median)
    assert result["machine"]["cpu"] and "torch" in result["machine"]
    width, height = _png(png)
    assert width > 400 and height > 300
    table = capsys.readouterr().out
    assert all(mode in table for mode in MODES) and "output tok/s" in table


def test_bench_throughput_counts_every_generated_token(tmp_path: Path) -> None:
    out, png = tmp_path / "throughput.json", tmp_path / "throughput.png"
    code = main(
        [*FAST, "bench", "throughput", *NO_INDUCTOR, "--num-prompts", "24", "--input-len", "8",
         "--output-len", "12", "--graph-modes", "NONE", "FULL_DECODE_ONLY",
         "--disable-detokenize", "--output-json", str(out), "--plot", str(png)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert list(result["results"]) == ["NONE", "FULL_DECODE_ONLY"]
    for row in result["results"].values():
        assert row["output_tokens_per_s"] == pytest.approx(24 * 12 / row["elapsed_time"])
        assert row["tokens_per_s"] == pytest.approx(24 * 20 / row["elapsed_time"])
    _png(png)


def test_disable_detokenize_asks_for_ids_only() -> None:
    parser = argparse.ArgumentParser()
    add_offline_args(parser, "throughput", "")
    assert offline_sampling_params(parser.parse_args([])).detokenize
    params = offline_sampling_params(parser.parse_args(["--disable-detokenize"]))
    assert params.detokenize is False and params.max_tokens == 128


@pytest.fixture(scope="module")
def server(stories_dir: Path) -> Iterator[RunningServer]:
    running = start_server(make_engine(stories_dir))
    yield running
    running.stop()


def test_bench_serve_against_a_running_server_completes_every_request(
    server: RunningServer, tmp_path: Path
) -> None:
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    code = main(
        [*FAST, "bench", "serve", "--base-url", server.base_url, "--num-prompts", "12",
         "--random-input-len", "8", "--random-output-len", "10", "--ignore-eos",
         "--request-rate", "20", "inf", "--max-concurrency", "6",
         "--output-json", str(out), "--plot", str(png)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert result["model"] == server.model_name
    assert [run["request_rate"] for run in result["runs"]] == [20.0, "inf"]
    for run in result["runs"]:
        assert run["completed"] == 12 and run["failed"] == 0 and run["errors"] == []
        assert run["total_output_tokens"] == 12 * 10
        assert run["total_input_tokens"] == 12 * 8
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            values = run[metric]
            assert values["median"] > 0 and not math.isnan(values["percentiles"]["99"])
        # ITL has one gap fewer than tokens per request; TTFT one value per request.
        assert run["ttft_ms"]["median"] <= run["e2el_ms"]["median"]
    _png(png)


def test_bench_serve_says_when_no_server_answers(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*FAST, "bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"])
    assert code == 2
    assert "no OpenAI-compatible server at http://127.0.0.1:9" in capsys.readouterr().err


def _generation_tokens(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("decodegraph:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("decodegraph:generation_tokens_total not in /metrics")


def test_bench_serve_sends_its_warmups_before_measuring_and_counts_none(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.json"
    before = _generation_tokens(server.base_url)
    code = main(
        [*FAST, "bench", "serve", "--base-url", server.base_url, "--num-prompts", "5",
         "--random-input-len", "8", "--random-output-len", "6", "--ignore-eos",
         "--num-warmups", "3", "--max-concurrency", "2", "--output-json", str(out)]
    )  # fmt: skip
    assert code == 0
    assert "warm-up: 3 requests, 0 failed" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["num_warmups"] == 3
    (run,) = result["runs"]
    assert run["completed"] == 5 and run["total_output_tokens"] == 5 * 6
    # The server generated for the warm-ups too: (5 + 3) requests of 6 tokens.
    assert _generation_tokens(server.base_url) - before == (5 + 3) * 6
