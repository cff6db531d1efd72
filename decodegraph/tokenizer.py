"""Load the tokenizer of a model: its directory, a `tokenizer` override, or a preset's."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from decodegraph.config import ModelConfig
from decodegraph.models.presets import get_preset_tokenizer, is_preset


def get_tokenizer(model_config: ModelConfig, path: Path | None) -> PreTrainedTokenizerBase | None:
    """The tokenizer for `model_config`, or None when `skip_tokenizer_init`.

    `path` is the resolved model directory (None for a preset). `model_config.tokenizer`,
    when set, overrides it (a directory or a hub id). A preset without an override gets
    the byte-level tokenizer built in code.
    """
    if model_config.skip_tokenizer_init:
        return None
    source = model_config.tokenizer
    if source is None:
        if is_preset(model_config.model):
            return get_preset_tokenizer()
        if path is None:
            raise ValueError(f"tokenizer: no directory to load it from for {model_config.model!r}")
        source = str(path)
    elif is_preset(source):
        return get_preset_tokenizer()
    # The model's revision says nothing about a separate tokenizer repository.
    revision = model_config.revision if source == model_config.model else None
    try:
        return AutoTokenizer.from_pretrained(source, revision=revision)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: could not load a tokenizer from {source!r}: {e}") from e
