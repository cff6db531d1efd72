"""What every tool-call parser does: find the tool calls in a model's text."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from decodegraph.entrypoints.openai.tool_parsers.partial_json import (
    scan_string,
    scan_value,
    skip_whitespace,
)
from decodegraph.entrypoints.openai.tool_protocol import ToolCall


@dataclass
class ExtractedToolCallInformation:
    """vLLM's name: whether the text called tools, the calls, and the text around them."""

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    # The text that is not a tool call (None when there is none).
    content: str | None = None


@dataclass
class PartialToolCall:
    """A call in a text still being written, as far as it is known."""

    # None until its "name" string is complete.
    name: str | None
    # The arguments' JSON so far, spelled as the finished call's (partial_json.py).
    arguments: str
    # The call's object is complete.
    complete: bool
    # Where its object's text ends (or the scan stopped).
    end: int


class ToolParser:
    """Base of the `--tool-call-parser` parsers.

    Streaming needs three answers of a parser: how much of a partial text is surely
    plain content (`content_end`), which calls a partial text holds so far
    (`extract_tool_calls(text, final=False)`: the complete ones; `stream_calls`: each
    with its arguments so far, for argument deltas), and the calls of the whole text.
    """

    def extract_tool_calls(
        self, model_output: str, final: bool = True
    ) -> ExtractedToolCallInformation:
        """The tool calls in `model_output`. With `final=False` the text may still grow:
        only calls that more text cannot change are returned."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How many leading characters of a partial `text` are content whatever follows."""
        raise NotImplementedError

    def stream_calls(self, text: str, final: bool) -> list[PartialToolCall]:
        """The calls of a partial `text` in order, the last possibly incomplete; with
        `final` the text is whole. Calls from the first one that is not valid JSON on."""
        raise NotImplementedError


def scan_call(text: str, pos: int, argument_keys: tuple[str, ...], final: bool) -> PartialToolCall:
    """The call object `{"name": ..., <an argument key>: {...}}` at `text[pos:]` as far
    as it is written; the first of `argument_keys` found holds the arguments (absent:
    `{}` once the object is complete). ValueError for text that is not such an object."""
    pos = skip_whitespace(text, pos)
    name: str | None = None
    arguments = ""
    found = False

    def partial(at: int) -> PartialToolCall:
        return PartialToolCall(name, arguments, False, at)

    if pos >= len(text):
        return partial(pos)
    if text[pos] != "{":
        raise ValueError(f"expected a call object at {pos}")
    pos = skip_whitespace(text, pos + 1)
    while pos < len(text) and text[pos] != "}":
        key = scan_string(text, pos)
        pos = skip_whitespace(text, key.pos)
        if not key.complete or pos >= len(text):
            return partial(pos)
        if text[pos] != ":":
            raise ValueError(f"expected ':' at {pos}")
        key_name = json.loads(key.text)
        value = scan_value(text, pos + 1, final)
        if key_name == "name":
            if value.text and not value.text.startswith('"'):
                raise ValueError("a call's name must be a string")
            if value.complete:
                name = json.loads(value.text)
        elif key_name in argument_keys and not found:
            arguments = value.text
            if value.text:
                found = True
        pos = skip_whitespace(text, value.pos)
        if not value.complete or pos >= len(text):
            return partial(pos)
        if text[pos] == ",":
            pos = skip_whitespace(text, pos + 1)
            if pos < len(text) and text[pos] == "}":
                raise ValueError(f"a trailing ',' before {pos}")
        elif text[pos] != "}":
            raise ValueError(f"expected ',' or '}}' at {pos}")
    if pos >= len(text):
        return partial(pos)
    if name is None:
        raise ValueError("a call needs a name")
    return PartialToolCall(name, arguments if found else "{}", True, pos + 1)


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
