"""The package's layers import one way (docs/design.md §3), and its top-level names load
lazily: importing one part of it does not load transformers or the engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "decodegraph"

# Layer -> the layers it must not import at run time (type-only imports are fine).
TOP = {"entrypoints", "engine"}
ABOVE_MODEL = TOP | {"core", "worker"}
FORBIDDEN = {
    "core": TOP | {"worker", "graphs", "attention", "models", "layers", "sample", "platforms"},
    "worker": TOP,
    "graphs": ABOVE_MODEL | {"sample", "models"},
    "attention": ABOVE_MODEL | {"graphs", "sample", "models"},
    "sample": ABOVE_MODEL | {"graphs", "attention", "models", "platforms"},
    "models": ABOVE_MODEL | {"graphs", "sample"},
    "layers": ABOVE_MODEL | {"graphs", "sample", "models"},
    "platforms": ABOVE_MODEL | {"graphs", "attention", "models", "layers", "sample"},
    "native": ABOVE_MODEL | {"graphs", "attention", "models", "layers", "sample", "platforms"},
    # Shared modules both sides of a boundary import.
    "request": ABOVE_MODEL | {"graphs"},
    **dict.fromkeys(("forward_context", "sampling_params", "outputs"), ABOVE_MODEL | {"graphs"}),
}


def _runtime_imports(path: Path) -> set[str]:
    """The decodegraph sub-packages and modules a file imports outside `if TYPE_CHECKING`."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "decodegraph":
                if len(parts) > 1:
                    found.add(parts[1])
                else:
                    found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "decodegraph" and len(parts) > 1:
                    found.add(parts[1])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_no_layer_above_it(layer: str) -> None:
    files = [p for p in PACKAGE.rglob("*.py") if _layer(p) == layer]
    assert files, f"no module for layer {layer}"
    bad = {
        str(p.relative_to(PACKAGE)): sorted(_runtime_imports(p) & FORBIDDEN[layer]) for p in files
    }
    assert not {k: v for k, v in bad.items() if v}


def test_importing_the_graph_modes_loads_neither_transformers_nor_the_engine() -> None:
    code = (
        "import sys, decodegraph.graphs.modes\n"
        "print(sorted(m for m in ('transformers', 'decodegraph.engine', "
        "'decodegraph.worker', 'decodegraph.entrypoints') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_top_level_names_load_on_first_use() -> None:
    code = (
        "import sys, decodegraph\n"
        "assert 'decodegraph.entrypoints.llm' not in sys.modules\n"
        "from decodegraph import LLM, SamplingParams, CUDAGraphMode\n"
        "print(LLM.__module__, SamplingParams.__module__, CUDAGraphMode.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "decodegraph.entrypoints.llm",
        "decodegraph.sampling_params",
        "decodegraph.graphs.modes",
    ]
