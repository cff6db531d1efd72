"""The `decodegraph` command line: real subprocesses for whole runs, `main()` in-process
for argument errors (they fail before any model is loaded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from decodegraph.entrypoints.cli import main
from tests.conftest import STORIES_GREEDY_TEXT

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
    assert "graph mode NONE" in proc.stderr


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
    assert "Prompt: 'Once upon a time'" in proc.stdout and "Prompt: 'Lily'" in proc.stdout
    assert "Generated: ', there was a little girl named'" in proc.stdout
    assert "graph mode NONE" in proc.stderr


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
