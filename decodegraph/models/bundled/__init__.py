"""Models that ship inside the package (data, not code): the demo model stories260K.

`decodegraph generate` with no `--model` runs `DEFAULT_MODEL`; `LLM("stories260K")` or
`--model stories260K` find it by name wherever the package is installed.
"""

from __future__ import annotations

from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "stories260K"


def bundled_model_names() -> list[str]:
    """The bundled models' names (their folder names)."""
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").is_file())


def bundled_model_path(name: str) -> Path | None:
    """The folder of the bundled model `name`, or None when there is none."""
    path = BUNDLED_DIR / name
    return path if "/" not in name and (path / "config.json").is_file() else None
