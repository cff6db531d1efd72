"""get_tokenizer: model directory, override, preset, and skip_tokenizer_init."""

from __future__ import annotations

from pathlib import Path

import pytest

from decodegraph.config import ModelConfig
from decodegraph.models.presets import BOS_TOKEN_ID
from decodegraph.tokenizer import get_tokenizer


def test_tokenizer_loads_from_the_model_directory(stories_dir: Path) -> None:
    tok = get_tokenizer(ModelConfig(model=str(stories_dir)), stories_dir)
    assert tok is not None and len(tok) == 512
    ids = tok("Once upon a time").input_ids
    assert ids[0] == tok.bos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == "Once upon a time"


def test_tokenizer_override_wins_over_the_model(stories_dir: Path) -> None:
    mc = ModelConfig(model="preset:llama-tiny", tokenizer=str(stories_dir))
    tok = get_tokenizer(mc, None)
    assert tok is not None and len(tok) == 512


def test_preset_gets_the_byte_level_tokenizer() -> None:
    tok = get_tokenizer(ModelConfig(model="preset:llama-tiny"), None)
    assert tok is not None and tok("a").input_ids == [BOS_TOKEN_ID, ord("a")]


def test_skip_tokenizer_init_returns_none(stories_dir: Path) -> None:
    assert (
        get_tokenizer(ModelConfig(model=str(stories_dir), skip_tokenizer_init=True), stories_dir)
        is None
    )


def test_directory_without_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer: could not load a tokenizer from"):
        get_tokenizer(ModelConfig(model=str(tmp_path)), tmp_path)
