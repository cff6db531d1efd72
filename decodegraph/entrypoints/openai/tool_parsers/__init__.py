"""Tool-call parsers by `--tool-call-parser` name (vLLM's names)."""

from __future__ import annotations

from decodegraph.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    PartialToolCall,
    ToolParser,
)
from decodegraph.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from decodegraph.entrypoints.openai.tool_parsers.llama3_json_tool_parser import (
    Llama3JsonToolParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError listing the names otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"tool_call_parser: {name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


__all__ = [
    "ExtractedToolCallInformation",
    "PartialToolCall",
    "TOOL_PARSERS",
    "ToolParser",
    "get_tool_parser",
]
