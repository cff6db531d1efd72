"""What every tool-call parser does: find the tool calls in a model's text."""

from __future__ import annotations

from dataclasses import dataclass, field

from decodegraph.entrypoints.openai.tool_protocol import ToolCall


@dataclass
class ExtractedToolCallInformation:
    """vLLM's name: whether the text called tools, the calls, and the text around them."""

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    # The text that is not a tool call (None when there is none).
    content: str | None = None


class ToolParser:
    """Base of the `--tool-call-parser` parsers.

    Streaming needs two answers of a parser: how much of a partial text is surely plain
    content (`content_end`), and which calls of a partial text are complete
    (`extract_tool_calls(text, final=False)`).
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


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
