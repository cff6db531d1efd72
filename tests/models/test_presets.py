"""Presets: real shapes built in code, and the byte-level tokenizer built in code."""

from __future__ import annotations

import pytest

from decodegraph.models.presets import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PRESET_VOCAB_SIZE,
    get_preset_config,
    get_preset_tokenizer,
)
from decodegraph.models.registry import get_model_class


def test_llama_3_2_1b_preset_has_the_published_shapes() -> None:
    c = get_preset_config("preset:llama-3.2-1b")
    shapes = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads)
    assert shapes == (2048, 16, 32, 8)
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (64, 8192, 128256)
    assert c.tie_word_embeddings and str(c.dtype) == "torch.bfloat16"
    assert c.rope_parameters["rope_type"] == "llama3" and c.rope_parameters["factor"] == 32.0


def test_qwen3_0_6b_preset_has_the_published_shapes() -> None:
    c = get_preset_config("qwen3-0.6b")
    assert (c.hidden_size, c.num_hidden_layers, c.head_dim, c.vocab_size) == (1024, 28, 128, 151936)
    assert get_model_class(c).__name__ == "Qwen3ForCausalLM"


def test_tiny_presets_use_the_tokenizer_vocabulary() -> None:
    for name in ("llama-tiny", "qwen3-tiny"):
        c = get_preset_config(name)
        assert c.vocab_size == PRESET_VOCAB_SIZE
        assert (c.bos_token_id, c.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)


def test_unknown_preset_error_lists_presets() -> None:
    with pytest.raises(ValueError, match="unknown preset 'nope'.*preset:llama-tiny"):
        get_preset_config("preset:nope")


def test_preset_tokenizer_round_trips_multibyte_text_with_bos() -> None:
    tok = get_preset_tokenizer()
    text = "héllo wörld 🙂"
    ids = tok(text).input_ids
    assert ids[0] == BOS_TOKEN_ID
    assert ids[1:] == list(text.encode("utf-8"))  # byte tokens have the byte's id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok) == PRESET_VOCAB_SIZE and tok.eos_token_id == EOS_TOKEN_ID


def test_preset_tokenizer_has_a_chat_template() -> None:
    tok = get_preset_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<s><|user|>\nhi\n<|assistant|>\n"
