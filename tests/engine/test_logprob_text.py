"""Logprob token texts in context (engine/logprob_text.py) on stories260K's SentencePiece
tokenizer, byte-fallback tokens included: the pieces concatenate to the decoded text."""

from __future__ import annotations

from pathlib import Path

import pytest

from decodegraph.engine.logprob_text import TokenTexts, token_bytes

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "She said: café, naïve — ☃ and 日本!",
    "  two spaces,\nnew line and ▁ a literal marker",
]


@pytest.fixture(scope="module")
def tokenizer(stories_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_the_decoded_text(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert any(token_bytes(t) for t in tokenizer.convert_ids_to_tokens(ids)) or text.isascii()
    texts = TokenTexts(tokenizer, ids[:1])
    pieces = [texts.add(t)[0] for t in ids[1:]]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_leading_space_is_kept_and_alternatives_are_decoded_in_the_same_context(
    tokenizer,
) -> None:
    ids = tokenizer.encode("Once upon a time, there")
    texts = TokenTexts(tokenizer, ids[:-1])
    there, was = ids[-1], tokenizer.encode("was", add_special_tokens=False)[-1]
    own, alternatives = texts.add(there, [there, was])
    assert own == " there"
    assert alternatives[there] == " there"
    assert alternatives[was].startswith(" ") or alternatives[was] == "was"


def test_unfinished_character_is_held_and_alternatives_show_bytes(tokenizer) -> None:
    ids = tokenizer.encode("a ☃", add_special_tokens=False)
    byte_ids = [t for t in ids if token_bytes(tokenizer.convert_ids_to_tokens(t))]
    assert len(byte_ids) == 3  # ☃ is three UTF-8 bytes, each a byte-fallback token
    first = ids.index(byte_ids[0])
    texts = TokenTexts(tokenizer, ids[:first])
    own, alternatives = texts.add(byte_ids[0], [byte_ids[0], byte_ids[1]])
    assert own == ""  # held until the character is complete
    assert alternatives[byte_ids[1]] == "bytes:" + "".join(
        f"\\x{b:02x}" for b in token_bytes(tokenizer.convert_ids_to_tokens(byte_ids[1]))
    )
    assert texts.add(byte_ids[1])[0] == ""
    assert texts.add(byte_ids[2])[0] == "☃"


def test_special_alternative_shows_its_token_string(tokenizer) -> None:
    ids = tokenizer.encode("The end.")
    texts = TokenTexts(tokenizer, ids[:-1])
    eos = tokenizer.eos_token_id
    _, alternatives = texts.add(ids[-1], [ids[-1], eos])
    assert alternatives[eos] == "</s>"
