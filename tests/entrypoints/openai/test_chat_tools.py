"""ChatTools without a server: the "required" schema and its streamed calls."""

from __future__ import annotations

import json

from decodegraph.entrypoints.openai.chat_tools import ChatTools, required_tools_schema
from decodegraph.entrypoints.openai.tool_protocol import ToolFields

TOOLS = ToolFields(
    tools=[{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")],
    tool_choice="required",
)


def test_required_schema_is_a_list_of_named_calls_one_when_not_parallel() -> None:
    schema = required_tools_schema(TOOLS)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    single = required_tools_schema(TOOLS.model_copy(update={"parallel_tool_calls": False}))
    assert single["maxItems"] == 1


def test_streamed_required_list_sends_each_call_once_it_is_complete() -> None:
    stream = ChatTools(TOOLS, False, None).stream()
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", '
    first = stream.feed(text, False)
    assert [c.function.name for c in first.tool_calls] == ["get_time"] and first.content is None
    last = stream.feed('"parameters": {"city": "Oslo", "days": 1}}]', True)
    assert [(c.index, c.function.name) for c in last.tool_calls] == [(1, "get_weather")]
    assert json.loads(last.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 1}


def test_required_schema_lifts_each_tools_defs_to_its_root() -> None:
    params = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/Point"}},
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
    tools = ToolFields(
        tools=[{"type": "function", "function": {"name": "f", "parameters": params}}]
    )
    schema = required_tools_schema(tools)
    assert schema["$defs"] == params["$defs"]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
