"""The bundled demo model: whole, licensed, found by name, and the published story."""

from __future__ import annotations

import hashlib

from decodegraph.entrypoints.llm import LLM
from decodegraph.models.bundled import (
    DEFAULT_MODEL,
    bundled_model_names,
    bundled_model_path,
)
from decodegraph.models.loader import resolve_model_path
from tests.conftest import STORIES_GREEDY_TEXT
from tests.utils.requests import greedy

FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "LICENSE",
    "README.md",
}


def test_the_demo_model_is_bundled_whole_with_its_license_and_provenance() -> None:
    assert DEFAULT_MODEL in bundled_model_names()
    path = bundled_model_path(DEFAULT_MODEL)
    assert path is not None and {p.name for p in path.iterdir()} >= FILES
    assert "MIT License" in (path / "LICENSE").read_text()
    readme = (path / "README.md").read_text()
    assert "karpathy/tinyllamas" in readme and STORIES_GREEDY_TEXT.split(".")[0] in readme
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert digest in readme  # the provenance names the very weights shipped


def test_a_bundled_model_is_found_by_name_and_nothing_else_is() -> None:
    assert resolve_model_path(DEFAULT_MODEL) == bundled_model_path(DEFAULT_MODEL)
    assert bundled_model_path("no-such-model") is None
    assert bundled_model_path("../bundled") is None


def test_the_bundled_model_by_name_tells_the_published_story() -> None:
    llm = LLM(DEFAULT_MODEL, enforce_eager=True, max_model_len=128)
    out = llm.generate([{"prompt_token_ids": [1]}], greedy(61), use_tqdm=False)[0]
    assert out.outputs[0].text == STORIES_GREEDY_TEXT
