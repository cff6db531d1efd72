"""The llama3_json parser on hand-written Llama 3.x outputs."""

from __future__ import annotations

import json

from decodegraph.entrypoints.openai.chat_tools import ChatTools
from decodegraph.entrypoints.openai.tool_parsers import get_tool_parser
from decodegraph.entrypoints.openai.tool_protocol import ToolFields

parser = get_tool_parser("llama3_json")()


def test_one_call_with_parameters() -> None:
    info = parser.extract_tool_calls('{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert info.tools_called and info.content is None
    (call,) = info.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}


def test_python_tag_and_several_calls_separated_by_semicolons() -> None:
    text = (
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
        '{"name": "b", "arguments": {"y": "é"}}'
    )
    info = parser.extract_tool_calls(text)
    assert [c.function.name for c in info.tool_calls] == ["a", "b"]
    assert info.tool_calls[1].function.arguments == '{"y": "é"}'


def test_prose_and_broken_json_are_content() -> None:
    for text in ("The weather is fine.", '{"name": "a", "parameters": '):
        info = parser.extract_tool_calls(text)
        assert not info.tools_called and info.content == text


def test_streamed_call_is_named_once_its_name_is_complete_and_prose_streams() -> None:
    tools = ToolFields(tools=[{"type": "function", "function": {"name": "a"}}])
    stream = ChatTools(tools, True, parser).stream()
    assert stream.feed('{"name": "a', False).tool_calls == []
    (first,) = stream.feed('", "parameters": {', False).tool_calls
    assert (first.function.name, first.function.arguments) == ("a", "{")
    (rest,) = stream.feed("}}", False).tool_calls
    assert (rest.function.name, rest.function.arguments) == (None, "}")
    assert stream.feed("", True).tool_calls == []
    prose = ChatTools(tools, True, parser).stream()
    assert prose.feed("Hello", False).content == "Hello"
