"""The `decodegraph` command line: real subprocesses for whole runs, `main()` in-process
for argument errors (they fail before any model is loaded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from decodegraph.attention.backends.base import AttentionCGSupport
from decodegraph.attention.backends.torch_paged import CPUAttentionBackend
from decodegraph.attention.selector import ENV_VAR
from decodegraph.entrypoints.cli import build_parser, generate_engine_args, main
from tests.conftest import STORIES_GREEDY_TEXT
from tests.utils.platforms import registered_backend

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "decodegraph", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_from_bos_prints_the_published_stories_text(stories_dir: Path) -> None:
    # The default mode is FULL_DECODE_ONLY: "graph mode NONE" shows the JSON was applied.
    proc = run_cli(
        "generate",
        "--model",
        str(stories_dir),
        "--max-tokens",
        "70",
        "--compilation-config",
        '{"cudagraph_mode": "NONE"}',
    )
    assert proc.returncode == 0, proc.stderr
    assert STORIES_GREEDY_TEXT in proc.stdout
    assert "graph mode NONE" in proc.stdout


def test_generate_with_no_model_runs_the_bundled_demo_model_and_says_so() -> None:
    """What `make demo` runs: the published story, a tokens/s figure, mode and steps."""
    proc = run_cli("--log-level", "WARNING", "generate", "--max-tokens", "61")
    assert proc.returncode == 0, proc.stderr
    assert "using the bundled demo model stories260K" in proc.stderr
    assert f"\n{STORIES_GREEDY_TEXT}\n" in proc.stdout
    summary = proc.stdout.strip().splitlines()[-1]
    assert "61 tokens in" in summary and "tokens/s" in summary
    assert "graph mode FULL_DECODE_ONLY; steps by mode: FULL 61" in summary


def test_enforce_eager_overrides_the_compilation_config_and_prompts_are_used(
    stories_dir: Path,
) -> None:
    proc = run_cli(
        "generate",
        "--model",
        str(stories_dir),
        "--prompt",
        "Once upon a time",
        "--prompt",
        "Lily",
        "--max-tokens",
        "9",
        "--enforce-eager",
        "-O",
        '{"cudagraph_mode": "FULL"}',
    )
    assert proc.returncode == 0, proc.stderr
    assert "prompt 0: 'Once upon a time'" in proc.stdout and "prompt 1: 'Lily'" in proc.stdout
    assert "\nOnce upon a time, there was a little girl named\n" in proc.stdout
    assert "graph mode NONE" in proc.stdout


def test_generate_help_shows_vllm_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model",
        "--prompt",
        "--max-tokens",
        "--temperature",
        "--seed",
        "--compilation-config",
        "--enforce-eager",
        "--max-model-len",
        "--max-num-seqs",
        "--tensor-parallel-size",
    ):
        assert flag in out


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "decodegraph"
    assert script.is_file()
    assert "decodegraph.entrypoints.cli" in script.read_text()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{cudagraph_mode: FULL", "compilation_config: not valid JSON"),
        ('{"cudagraph_mode": "FULL_GRAPH"}', "'FULL_GRAPH' is not one of NONE, PIECEWISE"),
        ('{"cudagraph_modes": "FULL"}', "unknown field(s) ['cudagraph_modes']"),
        ("[1, 2]", "compilation_config: expected a dict"),
    ],
)
def test_bad_compilation_config_is_a_clear_error_and_nonzero_exit(
    config: str, message: str, stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["generate", "--model", str(stories_dir), "--compilation-config", config])
    assert code != 0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_missing_model_directory_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["generate", "--model", str(tmp_path / "absent"), "--enforce-eager"])
    assert code != 0
    assert "is neither a local directory nor a valid Hugging Face hub id" in capsys.readouterr().err


def test_unknown_flag_exits_with_usage(
    stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(stories_dir), "--max-tokenz", "3"])
    assert info.value.code != 0
    assert "--max-tokenz" in capsys.readouterr().err


class _SingleTokenDecodeBackend(CPUAttentionBackend):
    """The CPU backend declaring less than it has (as CUDA's torch fallback does)."""

    name = "CPU_SINGLE_TOKEN_DECODE"
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_graphs_prints_a_readable_table_with_the_reason_of_a_downgrade(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = '{"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2], "use_inductor": false}'
    with registered_backend(_SingleTokenDecodeBackend) as name:
        monkeypatch.setenv(ENV_VAR, name)
        assert main(["--log-level", "WARNING", "graphs", "-O", config]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in
             out.splitlines() if "  " in line and not line.startswith(" ")}  # fmt: skip
    assert lines["model"] == "stories260K on cpu"
    assert lines["requested mode"] == "FULL"
    assert lines["resolved mode"] == "FULL_AND_PIECEWISE"
    assert "attention support is UNIFORM_SINGLE_TOKEN_DECODE" in lines["why"]
    assert lines["capture sizes"] == "1, 2"
    # Unset: made in the background once a batch needs it (none did here).
    assert lines["dynamic decode"] == (
        "3 to 256 requests, made in the background when a batch first needs it (not needed yet)"
    )
    assert lines["graphs"] == "14, FULL: 2, PIECEWISE: 12"
    assert lines["capture"].endswith("MiB") and lines["start-up"].startswith("load ")
    assert "FULL          decode" in out and "PIECEWISE     mixed" in out


def _generate_capture_sizes(argv: list[str]) -> list[int]:
    """The sizes an engine built by `generate` with these flags would capture."""
    from decodegraph.engine.arg_utils import UsageContext
    from decodegraph.graphs.graph_runner import GraphRunner
    from decodegraph.platforms.cpu import CpuPlatform

    args = build_parser().parse_args(["generate", *argv])
    engine_args = generate_engine_args(args, len(args.prompt or [""]))
    config = engine_args.create_engine_config(UsageContext.LLM_CLASS)
    runner = GraphRunner(config, CpuPlatform(), None, {}, None)  # type: ignore[arg-type]
    runner.resolve()
    return sorted(key.num_tokens for _, key in runner.dispatcher.all_keys())


@pytest.mark.parametrize(
    ("prompts", "sizes"),
    [(0, [1]), (1, [1]), (2, [1, 2]), (3, [1, 3]), (4, [1, 4]), (20, [1, 4, 8, 20])],
)
def test_generate_captures_only_the_batch_sizes_its_prompts_can_reach(
    stories_dir: Path, prompts: int, sizes: list[int]
) -> None:
    argv = ["--model", str(stories_dir)] + [f"--prompt=p{i}" for i in range(prompts)]
    assert _generate_capture_sizes(argv) == sizes


def test_generate_keeps_explicit_capture_sizes_up_to_its_batch(stories_dir: Path) -> None:
    argv = ["--model", str(stories_dir), "--prompt=a", "--prompt=b"]
    config = '{"cudagraph_capture_sizes": [1, 2, 16]}'
    assert _generate_capture_sizes([*argv, "--compilation-config", config]) == [1, 2]
