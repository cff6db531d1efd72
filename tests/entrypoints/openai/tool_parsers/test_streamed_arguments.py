"""Auto tool calls streamed as vLLM's parsers stream them: a call's first delta carries
its index, id, type and name, later ones fragments of its arguments, and the fragments
concatenate to the arguments of the plain answer. Fed piece by piece: stories260K's
tokens and single characters, for hermes and llama3_json, over JSON written every way
a model writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decodegraph.entrypoints.openai.chat_tools import ChatTools
from decodegraph.entrypoints.openai.tool_parsers import get_tool_parser
from decodegraph.entrypoints.openai.tool_parsers.partial_json import normalized_prefix
from decodegraph.entrypoints.openai.tool_protocol import ToolFields

TOOLS = ToolFields(
    tools=[{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
)
# Arguments as models write them: spaced, compact, escaped, nested, odd numbers.
ARGUMENTS = [
    '{"city": "Paris", "days": 2}',
    '{"city":"Rome","days":10}',
    '{ "text" : "line\\nbreak \\"quoted\\" caf\\u00e9 \\ud83d\\ude00 \\/" , "n" : 1.50 }',
    '{"deep": {"list": [1, -2.5e3, true, false, null, [], {}], "s": "é✓"}}',
    "{}",
]


def _hermes(arguments: str, name: str = "get_weather", prefix: str = "") -> str:
    return f'{prefix}<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _llama(arguments: str, name: str = "get_weather") -> str:
    return f'{{"name": "{name}", "parameters": {arguments}}}'


@pytest.fixture(scope="module")
def tokenizer(stories_dir: Path):  # noqa: ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(stories_dir))


def _token_pieces(tokenizer: object, text: str) -> list[str]:
    """The text as a model's stream has it: one decoded delta per token (empty while a
    character's bytes are incomplete, as the detokenizer holds them back)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, done = [], ""
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k])
        if now.endswith("\ufffd"):
            pieces.append("")
            continue
        pieces.append(now[len(done) :])
        done = now
    assert done == text
    return pieces


def _stream(parser_name: str, pieces: list[str]) -> tuple[str, dict[int, dict], list]:
    stream = ChatTools(TOOLS, True, get_tool_parser(parser_name)()).stream()
    content, calls, deltas = "", {}, []
    for k, piece in enumerate(pieces):
        out = stream.feed(piece, k == len(pieces) - 1)
        content += out.content or ""
        for d in out.tool_calls:
            deltas.append(d)
            if d.index not in calls:
                assert d.id and d.id.startswith("chatcmpl-tool-") and d.type == "function"
                assert d.function.name in ("get_weather", "get_time")
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.type is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert stream.called == bool(calls)
    return content, calls, deltas


@pytest.mark.parametrize("arguments", ARGUMENTS)
@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("split", ["tokens", "chars"])
def test_streamed_fragments_concatenate_to_the_plain_arguments(
    tokenizer: object, parser_name: str, arguments: str, split: str
) -> None:
    text = _hermes(arguments) if parser_name == "hermes" else _llama(arguments)
    pieces = _token_pieces(tokenizer, text) if split == "tokens" else list(text)
    content, calls, deltas = _stream(parser_name, pieces)
    plain = get_tool_parser(parser_name)().extract_tool_calls(text)
    (call,) = plain.tool_calls
    assert content == "" and list(calls) == [0]
    assert calls[0]["name"] == call.function.name
    assert calls[0]["arguments"] == call.function.arguments
    assert json.loads(calls[0]["arguments"]) == json.loads(arguments)
    if len(arguments) > 4:
        # Incremental: the arguments came in several deltas, not one at the end.
        assert sum(1 for d in deltas if d.function.arguments) > 2


def test_two_hermes_calls_after_content_stream_in_order(tokenizer: object) -> None:
    text = _hermes(ARGUMENTS[0], prefix="Let me check.") + _hermes('{"zone": "CET"}', "get_time")
    content, calls, _ = _stream("hermes", _token_pieces(tokenizer, text))
    assert content == "Let me check."
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert calls[1]["arguments"] == '{"zone": "CET"}'
    assert calls[0]["id"] != calls[1]["id"]


def test_llama3_calls_separated_by_semicolons_and_the_python_tag() -> None:
    text = "<|python_tag|>" + _llama('{"x": 1}') + "; " + _llama('{"zone":"UTC"}', "get_time")
    _, calls, _ = _stream("llama3_json", list(text))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", '{"x": 1}'),
        ("get_time", '{"zone": "UTC"}'),
    ]


def test_arguments_written_before_the_name_come_out_once_the_name_is_known() -> None:
    text = '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>'
    _, calls, deltas = _stream("hermes", list(text))
    assert calls == {0: {"id": deltas[0].id, "name": "get_time", "arguments": '{"zone": "UTC"}'}}


def test_a_call_cut_short_leaves_its_arguments_so_far_and_no_content() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": "UT'
    content, calls, _ = _stream("hermes", list(text))
    assert content == "" and calls[0]["arguments"] == '{"zone": "UT'


def test_plain_text_streams_as_content() -> None:
    content, calls, _ = _stream("hermes", list("Once upon a time <b> there"))
    assert content == "Once upon a time <b> there" and calls == {}


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_every_prefix_normalizes_to_a_prefix_of_the_whole(arguments: str) -> None:
    whole = json.dumps(json.loads(arguments), ensure_ascii=False)
    assert normalized_prefix(arguments, final=True) == (whole, True)
    for n in range(len(arguments)):
        part, complete = normalized_prefix(arguments[:n], final=False)
        assert whole.startswith(part) and not complete, (arguments[:n], part)


@pytest.mark.parametrize("first", ["parameters", "arguments"])
def test_llama3_takes_the_first_arguments_key_written_streamed_or_not(first: str) -> None:
    other = "arguments" if first == "parameters" else "parameters"
    text = f'{{"name": "get_time", "{first}": {{"a": 1}}, "{other}": {{"b": 2}}}}'
    plain = get_tool_parser("llama3_json")().extract_tool_calls(text)
    _, calls, _ = _stream("llama3_json", list(text))
    assert plain.tool_calls[0].function.arguments == calls[0]["arguments"] == '{"a": 1}'
