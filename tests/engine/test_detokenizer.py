"""Incremental detokenization on the real stories260K tokenizer (SentencePiece with
byte fallback): agreement with `tokenizer.decode`, UTF-8 split across byte tokens,
leading spaces, and stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from decodegraph.engine.detokenizer import IncrementalDetokenizer
from decodegraph.sampling_params import RequestOutputKind, SamplingParams

BOS = 1
# Byte-fallback tokens: <0x00> is id 3.
BYTE_OFFSET = 3


@pytest.fixture(scope="module")
def tokenizer(stories_dir: Path):
    return AutoTokenizer.from_pretrained(stories_dir)


def byte_tokens(text: str) -> list[int]:
    return [BYTE_OFFSET + b for b in text.encode()]


def random_valid_ids(rng: random.Random, pieces: int) -> list[int]:
    """Normal tokens, special tokens, and whole characters spelled as byte tokens."""
    ids: list[int] = []
    for _ in range(pieces):
        r = rng.random()
        if r < 0.6:
            ids.append(rng.randrange(259, 512))
        elif r < 0.65:
            ids.append(rng.randrange(0, 3))
        else:
            ids += byte_tokens(rng.choice("éñü中😀🚀€ßa\n"))
    return ids


def feed(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> str:
    """Feed ids in random chunks, collecting the streamed deltas."""
    streamed, i = "", 0
    while i < len(ids):
        k = rng.randrange(1, 4)
        detok.update(ids[i : i + k])
        i += k
        streamed += detok.get_next_output_text(finished=False, delta=True)
    return streamed + detok.get_next_output_text(finished=True, delta=True)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_sequences_match_a_full_decode(tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    for _ in range(150):
        prompt = [BOS] + random_valid_ids(rng, rng.randrange(0, 6))
        out = random_valid_ids(rng, rng.randrange(1, 20))
        params = SamplingParams(skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        streamed = feed(detok, out, rng)
        full = tokenizer.decode(prompt + out, skip_special_tokens=skip_special_tokens)
        prefix = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
        expected = full[len(prefix) :]
        assert detok.output_text == expected, (prompt, out)
        assert streamed == expected
        assert "\ufffd" not in streamed


@pytest.mark.parametrize("text", ["Once upon a time, café 😀 naïve", "日本語 🚀 ok", "über — ß"])
def test_emoji_and_accents_round_trip_without_replacement_chars(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(3 <= i < 259 for i in ids)  # really exercises byte fallback
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams())
    deltas = []
    for token_id in ids:
        detok.update([token_id])
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.output_text


def test_a_character_split_over_byte_tokens_appears_only_when_complete(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams())
    emoji = byte_tokens("😀")
    for token_id in emoji[:-1]:
        detok.update([token_id])
        assert detok.output_text == ""
    detok.update(emoji[-1:])
    assert detok.output_text == "😀"


def test_leading_space_of_the_first_output_token_is_kept_after_a_prompt(tokenizer) -> None:
    prompt = tokenizer.encode("Once upon")
    out = tokenizer.encode(" a time", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    detok.update(out)
    assert detok.output_text == " a time"
    # With only BOS before it, SentencePiece drops the leading space, as decode does.
    bos_only = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams())
    bos_only.update(out)
    assert bos_only.output_text == tokenizer.decode([BOS] + out, skip_special_tokens=True)
    no_prompt = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    no_prompt.update(out)
    assert no_prompt.output_text == tokenizer.decode(out) == "a time"


def test_prompt_ending_in_half_a_character_completes_in_the_output(tokenizer) -> None:
    emoji = byte_tokens("😀")
    prompt = tokenizer.encode("Hi") + emoji[:2]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    detok.update(emoji[2:] + tokenizer.encode(" ok", add_special_tokens=False))
    assert detok.output_text == "😀 ok"


def test_invalid_byte_sequences_do_not_break_the_stream(tokenizer) -> None:
    # '=' then stray continuation bytes: a full decode re-renders '=' as U+FFFD.
    out = (
        byte_tokens("=")
        + [BYTE_OFFSET + 0xC0, BYTE_OFFSET + 0x8E]
        + tokenizer.encode(" the end", add_special_tokens=False)
    )
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams())
    for token_id in out:
        detok.update([token_id])
    assert detok.get_next_output_text(finished=True, delta=False).endswith(" the end")


def test_held_invalid_bytes_are_flushed_at_the_end(tokenizer) -> None:
    out = tokenizer.encode(" dog", add_special_tokens=False) + [BYTE_OFFSET + 0xE2]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("A"), SamplingParams())
    detok.update(out)
    assert detok.get_next_output_text(finished=False, delta=False) == " dog"
    assert detok.get_next_output_text(finished=True, delta=False) == " dog\ufffd"


def stop_case(tokenizer, text: str, **params: object) -> tuple[IncrementalDetokenizer, list[str]]:
    """Stream `text` token by token; return the detokenizer and the deltas sent."""
    sp = SamplingParams(output_kind=RequestOutputKind.DELTA, **params)  # type: ignore[arg-type]
    detok = IncrementalDetokenizer(tokenizer, [BOS], sp)
    deltas = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        stop = detok.update([token_id])
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    return detok, deltas


def test_stop_string_truncates_the_text_and_is_reported(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams(stop=["a big", "Lily"]))
    ids = tokenizer.encode("She saw a big dog. Lily ran.", add_special_tokens=False)
    stops = [detok.update([i]) for i in ids]
    assert [s for s in stops if s] == ["a big"]
    assert detok.output_text == "She saw "
    assert detok.stopped


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer) -> None:
    detok, deltas = stop_case(
        tokenizer, "She saw a big dog.", stop=["a big"], include_stop_str_in_output=True
    )
    assert detok.output_text == "She saw a big"
    assert "".join(deltas) == "She saw a big"


def test_streamed_deltas_never_carry_part_of_a_stop_string(tokenizer) -> None:
    detok, deltas = stop_case(tokenizer, "One day, she saw a big, red ball.", stop=["big, red"])
    assert "".join(deltas) == "One day, she saw a "
    assert all("b" not in d for d in deltas)
    # Without a match, the hold-back is released at the end.
    detok, deltas = stop_case(tokenizer, "One day", stop=["xyzzy"])
    assert "".join(deltas) == "One"  # 4 characters (len("xyzzy") - 1) held back
    assert detok.get_next_output_text(finished=True, delta=True) == " day"


def test_stop_strings_wait_for_min_tokens(tokenizer) -> None:
    ids = tokenizer.encode("The cat. The dog.", add_special_tokens=False)
    first_dot = next(i for i, t in enumerate(ids) if "." in tokenizer.decode([t]))
    early = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams(stop=["."]))
    assert [early.update([t]) for t in ids[: first_dot + 1]][-1] == "."
    late = IncrementalDetokenizer(
        tokenizer, [BOS], SamplingParams(stop=["."], min_tokens=first_dot + 2)
    )
    stops = [late.update([t]) for t in ids]
    assert stops.index(".") > first_dot
    assert late.output_text == "The cat. The dog"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_final_only_text_equals_the_streamed_text(tokenizer, skip_special_tokens: bool) -> None:
    """FINAL_ONLY without stop strings feeds the stream only when the text is asked for;
    the text must be the same as stepping it every time (invalid bytes included)."""
    rng = random.Random(1)
    for _ in range(150):
        prompt = [BOS] + random_valid_ids(rng, rng.randrange(0, 6))
        out = random_valid_ids(rng, rng.randrange(1, 20))
        out += [rng.randrange(BYTE_OFFSET, BYTE_OFFSET + 256) for _ in range(rng.randrange(3))]
        texts = []
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            params = SamplingParams(skip_special_tokens=skip_special_tokens, output_kind=kind)
            detok = IncrementalDetokenizer(tokenizer, prompt, params)
            for i in range(0, len(out), 3):
                assert detok.update(out[i : i + 3]) is None
            texts.append(detok.get_next_output_text(finished=True, delta=False))
        assert texts[0] == texts[1], (prompt, out)
