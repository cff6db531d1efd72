"""JSON still being written, re-spelled as `json.dumps(value, ensure_ascii=False)` spells
the finished value, as far as what is written already decides it.

A streamed tool call sends its arguments in fragments whose concatenation must be the
arguments of the plain answer, which are `json.dumps` of the parsed value. A model's
raw text may differ from that spelling (no spaces, escapes such as `\\u00e9`, `1.50`),
so the fragments are not pieces of the raw text but of its re-spelling: every text
written so far maps to a prefix of the finished value's spelling (whitespace dropped,
`: ` and `, ` as separators, each string's characters as they are decoded, a number or
literal once it has ended), and each fragment is what that prefix grew by.

One value with a key given twice is the exception: `json.loads` keeps the last, the
prefix has already spelled the first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
# Where a number or literal ends.
_SCALAR_END = ",]}" + _WHITESPACE
_HIGH_SURROGATES = range(0xD800, 0xDC00)


@dataclass
class Scanned:
    """A value scanned from `pos`: its re-spelling so far, where the scan stopped, and
    whether the value is complete."""

    text: str
    pos: int
    complete: bool


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def normalized_prefix(text: str, final: bool) -> tuple[str, bool]:
    """The re-spelling of the JSON value `text` begins, and whether it is complete.
    `final`: no more text follows (a number at the very end has ended). ValueError for
    text that no continuation makes valid JSON."""
    out = scan_value(text, 0, final)
    return out.text, out.complete


def scan_value(text: str, pos: int, final: bool) -> Scanned:
    """Scan the value at `text[pos:]` (leading whitespace allowed)."""
    pos = skip_whitespace(text, pos)
    if pos >= len(text):
        return Scanned("", pos, False)
    c = text[pos]
    if c == "{":
        return _container(text, pos, final, "}")
    if c == "[":
        return _container(text, pos, final, "]")
    if c == '"':
        return scan_string(text, pos)
    return _scalar(text, pos, final)


def scan_string(text: str, pos: int) -> Scanned:
    """The string at `text[pos]` (a quote): its characters decoded so far, re-escaped;
    an escape is spelled once it is whole (a surrogate pair once both halves are)."""
    if text[pos] != '"':
        raise ValueError(f"expected a string at {pos}")
    i = pos + 1
    safe = i  # the raw text up to here decodes to whole characters
    while i < len(text):
        c = text[i]
        if c == '"':
            decoded = json.loads(text[pos : i + 1])
            return Scanned(json.dumps(decoded, ensure_ascii=False), i + 1, True)
        if c == "\\":
            if i + 1 >= len(text):
                break
            if text[i + 1] == "u":
                if i + 6 > len(text):
                    break
                i += 6
                if int(text[i - 4 : i], 16) in _HIGH_SURROGATES:
                    # A low half may follow: the pair is one character.
                    after = text[i : i + 2]
                    if after in ("", "\\") or (after == "\\u" and i + 6 > len(text)):
                        break  # not yet known
                    if after == "\\u":
                        i += 6
            else:
                i += 2
        else:
            i += 1
        safe = i
    decoded = json.loads(text[pos:safe] + '"')
    return Scanned(json.dumps(decoded, ensure_ascii=False)[:-1], safe, False)


def _container(text: str, pos: int, final: bool, close: str) -> Scanned:
    is_object = close == "}"
    out = [text[pos]]
    pos = skip_whitespace(text, pos + 1)
    if pos < len(text) and text[pos] == close:
        return Scanned(out[0] + close, pos + 1, True)
    while True:
        if pos >= len(text):
            return Scanned("".join(out), pos, False)
        if is_object:
            key = scan_string(text, pos)
            out.append(key.text)
            pos = skip_whitespace(text, key.pos)
            if not key.complete or pos >= len(text):
                return Scanned("".join(out), pos, False)
            if text[pos] != ":":
                raise ValueError(f"expected ':' at {pos}")
            out.append(": ")
            pos += 1
        item = scan_value(text, pos, final)
        out.append(item.text)
        pos = skip_whitespace(text, item.pos)
        if not item.complete or pos >= len(text):
            return Scanned("".join(out), pos, False)
        if text[pos] == close:
            out.append(close)
            return Scanned("".join(out), pos + 1, True)
        if text[pos] != ",":
            raise ValueError(f"expected ',' or {close!r} at {pos}")
        out.append(", ")
        pos = skip_whitespace(text, pos + 1)


def _scalar(text: str, pos: int, final: bool) -> Scanned:
    """A number or literal, spelled once it has ended (`1.50` is 1.5, `1e2` 100.0)."""
    end = pos
    while end < len(text) and text[end] not in _SCALAR_END:
        end += 1
    if end == len(text) and not final:
        return Scanned("", pos, False)
    value = json.loads(text[pos:end])
    if isinstance(value, (str, list, dict)):
        raise ValueError(f"expected a number or literal at {pos}")
    return Scanned(json.dumps(value), end, True)
