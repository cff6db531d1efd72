"""A wheel carries every source the CPU operators build from, and an install that cannot
build them says why, once, and how to silence it."""

from __future__ import annotations

import email
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import decodegraph.native as native
from decodegraph.native import load_cpu_ops

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "decodegraph" / "native" / "csrc"


def _csrc_files() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.is_file() and not p.name.startswith("."))


def test_the_wheel_holds_every_native_source_the_demo_model_and_declares_ninja(
    tmp_path: Path,
) -> None:
    # Built from a copy, so that setuptools' build/ and egg-info stay out of the checkout
    # (and no stale build/lib from an earlier build can hide a missing file).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "decodegraph",
        src / "decodegraph",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    out = tmp_path / "wheel"
    # The venv's setuptools (a dependency of torch) builds it: no index, no network.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("decodegraph-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        missing = [
            p.name for p in _csrc_files() if f"decodegraph/native/csrc/{p.name}" not in names
        ]
        assert not missing, f"the wheel lacks {missing}"
        for p in _csrc_files():
            assert zf.read(f"decodegraph/native/csrc/{p.name}") == p.read_bytes()
        # The bundled demo model, whole: weights, tokenizer, license, provenance.
        bundled = ROOT / "decodegraph" / "models" / "bundled" / "stories260K"
        for p in sorted(bundled.iterdir()):
            arcname = f"decodegraph/models/bundled/stories260K/{p.name}"
            assert arcname in names, f"the wheel lacks {arcname}"
            assert zf.read(arcname) == p.read_bytes()
        (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        requires = email.message_from_bytes(zf.read(metadata)).get_all("Requires-Dist")
    assert any(r.replace(" ", "").startswith("ninja") for r in requires), requires


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """load_cpu_ops() without its cached result; afterwards the patches are undone and the
    operators loaded again (from the on-disk build cache) for the tests that follow."""
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # load_cpu_ops may append ninja's dir
    monkeypatch.delenv("DECODEGRAPH_NATIVE_KERNELS", raising=False)
    load_cpu_ops.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    load_cpu_ops.cache_clear()
    load_cpu_ops()


def test_loading_the_operators_again_registers_their_fakes_once(
    fresh_load: pytest.MonkeyPatch,
) -> None:
    """A second load in one process (tests clear load_cpu_ops' cache) does not register
    the fake implementations again: torch 2.10 refuses a second registration."""
    assert load_cpu_ops() is not None

    def refuse(op: str, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"register_fake(...): the operator {op} already has a fake impl")

    fresh_load.setattr(torch.library, "register_fake", refuse)
    load_cpu_ops.cache_clear()
    assert load_cpu_ops() is not None


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= level]


def test_a_failed_build_warns_once_with_the_reason_and_the_silencing_variable(
    fresh_load: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch.utils.cpp_extension

    calls = []

    def fail(**kwargs: object) -> None:
        calls.append(kwargs)
        raise RuntimeError("ninja not found")

    fresh_load.setattr(torch.utils.cpp_extension, "load", fail)
    with caplog.at_level(logging.DEBUG):
        assert load_cpu_ops() is None
        assert load_cpu_ops() is None  # cached: no second build, no second warning
    assert len(calls) == len(native._flag_sets(native._isa()))
    (warning,) = _records(caplog, logging.WARNING)
    assert warning.levelno == logging.WARNING
    assert "ninja not found" in warning.getMessage()
    assert "DECODEGRAPH_NATIVE_KERNELS=0" in warning.getMessage()


def test_kernels_disabled_by_the_variable_log_nothing(
    fresh_load: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch.utils.cpp_extension

    def fail(**kwargs: object) -> None:
        raise AssertionError("no build when DECODEGRAPH_NATIVE_KERNELS=0")

    fresh_load.setattr(torch.utils.cpp_extension, "load", fail)
    fresh_load.setenv("DECODEGRAPH_NATIVE_KERNELS", "0")
    with caplog.at_level(logging.DEBUG):
        assert load_cpu_ops() is None
    assert [r for r in caplog.records if r.name.startswith("decodegraph")] == []


def test_an_install_without_csrc_imports_and_says_what_is_missing(
    fresh_load: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    fresh_load.setattr(native, "_CSRC", tmp_path / "absent")
    with caplog.at_level(logging.WARNING):
        assert load_cpu_ops() is None
    (warning,) = _records(caplog, logging.WARNING)
    assert "No such file or directory" in warning.getMessage()
    assert "absent" in warning.getMessage()


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")
def test_a_missing_header_is_named_in_the_warning(
    fresh_load: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """What a wheel without its headers did: the compile fails on the first missing one
    (a real compile, into an empty build cache; it stops at the preprocessor)."""
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    (csrc / "vec.h").unlink()
    fresh_load.setattr(native, "_CSRC", csrc)
    fresh_load.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert load_cpu_ops() is None
    (warning,) = _records(caplog, logging.WARNING)
    message = warning.getMessage()
    assert "vec.h" in message and "error" in message, message
    assert "DECODEGRAPH_NATIVE_KERNELS=0" in message


def test_two_checkouts_of_the_same_sources_build_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's builder rebuilds a library whose build command changed (the include path
    names the checkout), so the same sources in two places must not share a directory."""
    from decodegraph import native

    flags = ["-O3"]
    here = native._build_key(native._sources(), flags)
    assert native._build_key(native._sources(), flags) == here
    copy = tmp_path / "csrc"
    shutil.copytree(native._CSRC, copy)
    monkeypatch.setattr(native, "_CSRC", copy)
    assert native._build_key(native._sources(), flags) != here
    assert native._build_key(native._sources(), ["-O2"]) != native._build_key(
        native._sources(), flags
    )


def test_the_reason_of_a_failed_compile_is_its_diagnostic_not_the_command_line() -> None:
    err = RuntimeError(
        "Error building extension 'decodegraph_cpu_ops_0123': [1/2] c++ -MMD -MF cpu_ops.o.d "
        "-O3 -c cpu_ops.cpp -o cpu_ops.o\n"
        "FAILED: [code=127] cpu_ops.o\n"
        "c++ -MMD -MF cpu_ops.o.d -O3 -c cpu_ops.cpp -o cpu_ops.o\n"
        "/bin/sh: 1: c++: not found\n"
        "ninja: build stopped: subcommand failed.\n"
    )
    assert native._reason(err) == (
        "Error building extension 'decodegraph_cpu_ops_0123': /bin/sh: 1: c++: not found"
    )
    assert native._reason(RuntimeError("Ninja is required to load C++ extensions")) == (
        "Ninja is required to load C++ extensions"
    )
