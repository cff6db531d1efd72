"""The text of each logprob token: its decoded piece in context (`Logprob.decoded_token`).

A token's text alone is not what it adds to a sequence: SentencePiece writes a leading
space as "▁" that `decode([id])` strips, and a byte-fallback token (`<0xE2>`) is a
fraction of a character. So a token's text here is what it adds after the tokens before
it: `decode(context + [id])` less `decode(context)`. The pieces of a sequence's tokens
then concatenate to its text (as the detokenizer writes it), and `text_offset` indexes
into it.

The bytes of an unfinished UTF-8 character are held back as the detokenizer holds them:
such a token's piece is "" and the token that completes the character carries all of
it. An alternative (top-k) token that would leave a character unfinished is shown as
OpenAI shows such tokens, "bytes:" and its escaped bytes; a special token that decodes
to nothing is shown as its token string ("</s>"), so the top-k keys stay apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from decodegraph.engine.detokenizer import backend_tokenizer

# Tokens before the one decoded that give it its context (leading-space rules, merges).
_CONTEXT = 6
# A UTF-8 character has at most 4 bytes: more held tokens than that are invalid bytes.
_MAX_HELD = 3
_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(token: str | None) -> bytes | None:
    """The raw byte of a byte-fallback token string ("<0xE2>" -> b"\\xe2"), else None."""
    if token is None:
        return None
    match = _BYTE_TOKEN.match(token)
    return bytes([int(match.group(1), 16)]) if match else None


class TokenTexts:
    """The pieces of one sequence's tokens, each decoded after the tokens before it."""

    def __init__(self, tokenizer: Any, context_ids: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._backend = backend_tokenizer(tokenizer)
        self._skip_special = skip_special_tokens
        self._ids = list(context_ids)
        # Tokens up to here decode to whole characters; the rest are held back.
        self._committed = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int, alternatives: Iterable[int] = ()) -> tuple[str, dict[int, str]]:
        """Append `token_id` to the sequence; return its piece and the pieces the
        `alternatives` would have added in its place."""
        context = self._ids[max(0, self._committed - _CONTEXT) : self._committed]
        held = self._ids[self._committed :]
        base = self._decode(context)

        def piece(t: int) -> str | None:
            full = self._decode(context + held + [t])
            if full.endswith(_REPLACEMENT) and len(held) < _MAX_HELD:
                tail = full[len(base) :] if full.startswith(base) else full
                if tail.endswith(_REPLACEMENT) and self._decode([t]).endswith(_REPLACEMENT):
                    return None  # an unfinished character
            if full.startswith(base):
                return full[len(base) :]
            return self._decode(held + [t])

        own = piece(token_id)
        self._ids.append(token_id)
        if own is None:
            own = ""
        else:
            self._committed = len(self._ids)
        texts: dict[int, str] = {}
        for t in alternatives:
            if t == token_id:
                texts[t] = own
                continue
            text = piece(t)
            if text is None:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in self._raw_bytes(t))
            elif not text:
                text = self._token_string(t) or text
            texts[t] = text
        return own, texts

    def _token_string(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def _raw_bytes(self, token_id: int) -> bytes:
        raw = token_bytes(self._token_string(token_id))
        return raw if raw is not None else self._decode([token_id]).encode()
