"""The hermes parser on hand-written model outputs, whole and streamed piece by piece."""

from __future__ import annotations

import json

from decodegraph.entrypoints.openai.chat_tools import ChatTools
from decodegraph.entrypoints.openai.tool_parsers import get_tool_parser
from decodegraph.entrypoints.openai.tool_protocol import ToolFields

parser = get_tool_parser("hermes")()
TWO_CALLS = (
    "Let me check.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
TOOLS = ToolFields(
    tools=[{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
)


def test_calls_and_content_before_them() -> None:
    info = parser.extract_tool_calls(TWO_CALLS)
    assert info.tools_called and info.content == "Let me check."
    assert [c.function.name for c in info.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(info.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in info.tool_calls)


def test_text_without_a_call_or_with_broken_json_is_content() -> None:
    for text in ("Once upon a time", "<tool_call>{not json}</tool_call>"):
        info = parser.extract_tool_calls(text)
        assert not info.tools_called and info.content == text


def test_an_unclosed_last_call_counts_when_the_output_ends() -> None:
    info = parser.extract_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert info.tools_called and info.content is None
    assert info.tool_calls[0].function.arguments == "{}"


def test_streamed_pieces_give_content_then_each_call_named_once() -> None:
    stream = ChatTools(TOOLS, True, parser).stream()
    content, calls = "", []
    pieces = [TWO_CALLS[i : i + 3] for i in range(0, len(TWO_CALLS), 3)]
    for k, piece in enumerate(pieces):
        delta = stream.feed(piece, k == len(pieces) - 1)
        content += delta.content or ""
        assert "<" not in (delta.content or ""), "a marker's start is held back"
        calls += delta.tool_calls
    assert content == "Let me check."
    named = [(c.index, c.function.name) for c in calls if c.function.name is not None]
    assert named == [(0, "get_weather"), (1, "get_time")]
    for index, call in enumerate(parser.extract_tool_calls(TWO_CALLS).tool_calls):
        streamed = "".join(c.function.arguments or "" for c in calls if c.index == index)
        assert streamed == call.function.arguments
    assert stream.called


def test_streamed_plain_text_with_a_lone_angle_bracket_comes_out_whole() -> None:
    stream = ChatTools(TOOLS, True, parser).stream()
    out = [stream.feed("a <b", False).content, stream.feed("> c", True).content]
    assert "".join(o or "" for o in out) == "a <b> c" and not stream.called
