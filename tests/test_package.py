"""The package itself: what importing `decodegraph` does to the process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A handler registered before the import runs after the package's (last-in, first-out):
# it sees whether the collector's objects were frozen before the interpreter's teardown
# collections. One registered after the import runs before it, with the collector intact.
_CHILD = """
import atexit, gc, sys
atexit.register(lambda: print("last", gc.get_freeze_count() > 0))
import decodegraph
atexit.register(lambda: print("first", gc.get_freeze_count() > 0))
"""


def test_exit_freezes_the_collector_after_every_later_handler():
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[:2] == ["first False", "last True"]
