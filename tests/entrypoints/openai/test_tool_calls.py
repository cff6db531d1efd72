"""Tool calls through the official `openai` client against a real server on stories260K
started with --enable-auto-tool-choice --tool-call-parser hermes: "required" and named
tool choices are enforced by structured outputs and give valid arguments, plain and
streamed; the template sees the tools; vLLM's 400s for bad combinations."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from decodegraph.entrypoints.openai.api_server import make_arg_parser
from tests.utils.server import MODEL_NAME, RunningServer, make_engine, start_server

# Renders the tools' names, so a test can see that the template got them.
TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(', ') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def server(stories_dir: Path) -> Iterator[RunningServer]:
    engine = make_engine(
        stories_dir, max_model_len=256, structured_outputs_config={"disable_any_whitespace": True}
    )
    running = start_server(
        engine,
        chat_template=TOOLS_TEMPLATE,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def plain_server(stories_dir: Path) -> Iterator[RunningServer]:
    """No --enable-auto-tool-choice."""
    engine = make_engine(
        stories_dir, max_model_len=128, structured_outputs_config={"disable_any_whitespace": True}
    )
    running = start_server(engine, chat_template=TOOLS_TEMPLATE)
    yield running
    running.stop()


def _check_arguments(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "days"}
        assert args["city"] in ("Paris", "Rome", "Oslo") and 1 <= args["days"] <= 9
    else:
        assert name == "get_time" and args == {"zone": args["zone"]}
        assert args["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_gives_valid_calls(server: RunningServer, seed: int) -> None:
    out = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=80,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    _check_arguments(call.function.name, call.function.arguments)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_tool_choice_gives_that_functions_arguments(server: RunningServer, seed: int) -> None:
    out = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=seed,
        max_tokens=40,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _check_arguments("get_weather", call.function.arguments)


def _streamed(server: RunningServer, **kwargs) -> tuple[dict[int, dict], str | None, str]:
    """Tool calls assembled from the deltas by index, the finish reason, the content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, stream=True, **kwargs
    ):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id is not None:
                    assert call["id"] is None, "the id comes once"
                    call["id"] = d.id
                if d.function is not None:
                    if d.function.name is not None:
                        call["name"] = d.function.name
                    call["arguments"] += d.function.arguments or ""
            if c.finish_reason is not None:
                finish = c.finish_reason
    return calls, finish, content


def test_streamed_required_and_named_tool_calls_assemble_to_valid_calls(
    server: RunningServer,
) -> None:
    calls, finish, _ = _streamed(
        server, tool_choice="required", parallel_tool_calls=False, seed=4, max_tokens=80
    )
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    _check_arguments(calls[0]["name"], calls[0]["arguments"])
    calls, finish, _ = _streamed(
        server,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        seed=5,
        max_tokens=40,
    )
    assert finish == "stop" and list(calls) == [0] and calls[0]["name"] == "get_time"
    _check_arguments("get_time", calls[0]["arguments"])


def test_auto_tool_choice_without_a_call_is_plain_content(server: RunningServer) -> None:
    out = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=8
    )
    choice = out.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason == "length"


def test_template_renders_the_tools(server: RunningServer) -> None:
    client = server.client()
    with_tools = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    without = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    rendered = server.async_llm.engine.apply_chat_template(
        MESSAGES, chat_template=TOOLS_TEMPLATE, tools=TOOLS
    )
    assert rendered.startswith("tools: get_weather, get_time\n")
    prompt_ids = server.async_llm.engine.tokenizer.encode(rendered)
    assert with_tools.usage.prompt_tokens == len(prompt_ids) > without.usage.prompt_tokens


def test_tool_history_reaches_the_template(server: RunningServer) -> None:
    """An assistant turn with tool_calls and a tool turn are accepted and rendered."""
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "noon"},
    ]
    out = server.client().chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert out.choices[0].message.content is not None


def _status(call) -> openai.APIStatusError:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value


def test_auto_without_enable_auto_tool_choice_is_vllms_400(plain_server: RunningServer) -> None:
    client = plain_server.client()
    for choice in ("auto", None):
        kwargs = {"tool_choice": choice} if choice else {}
        err = _status(
            lambda kwargs=kwargs: client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=2, **kwargs
            )
        )
        assert "--enable-auto-tool-choice" in err.message
        assert err.body["param"] == "tool_choice"
    # "required" and named choices need no parser.
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=20,
    )
    _check_arguments("get_time", out.choices[0].message.tool_calls[0].function.arguments)


def test_bad_tool_choices_are_400_naming_the_field(server: RunningServer) -> None:
    client = server.client()
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ]
    for kwargs, param in cases:
        err = _status(
            lambda kwargs=kwargs: client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=2, **kwargs
            )
        )
        assert err.body["param"] == param, (kwargs, err.body)


def test_serve_flags_parse_with_vllms_names() -> None:
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(
        ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    )
    assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        make_arg_parser(argparse.ArgumentParser()).parse_args(["--tool-call-parser", "nope"])


# What a Hermes-style model writes to call get_time; a guided choice makes stories260K
# write exactly this, so the auto path's parsing runs end to end.
HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_time", "parameters": {"zone": "CET"}}'


@pytest.fixture(scope="module")
def llama_server(stories_dir: Path) -> Iterator[RunningServer]:
    running = start_server(
        make_engine(stories_dir, max_model_len=256),
        chat_template=TOOLS_TEMPLATE,
        enable_auto_tool_choice=True,
        tool_call_parser="llama3_json",
    )
    yield running
    running.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_auto_tool_choice_parses_a_written_call(
    server: RunningServer, llama_server: RunningServer, parser: str, stream: bool
) -> None:
    running, text, zone = (
        (server, HERMES_CALL, "UTC") if parser == "hermes" else (llama_server, LLAMA_CALL, "CET")
    )
    kwargs = {"tool_choice": "auto", "max_tokens": 150, "extra_body": {"guided_choice": [text]}}
    if stream:
        calls, finish, content = _streamed(running, **kwargs)
        assert content == "" and list(calls) == [0]
        call = calls[0]
        name, arguments = call["name"], call["arguments"]
        assert call["id"].startswith("chatcmpl-tool-")
    else:
        out = running.client().chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, **kwargs
        )
        finish = out.choices[0].finish_reason
        assert not out.choices[0].message.content
        (tool_call,) = out.choices[0].message.tool_calls
        name, arguments = tool_call.function.name, tool_call.function.arguments
    assert finish == "tool_calls"
    assert name == "get_time" and json.loads(arguments) == {"zone": zone}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_streamed_auto_tool_call_arguments_come_in_fragments(
    server: RunningServer, llama_server: RunningServer, parser: str
) -> None:
    """As vLLM's parsers stream them: the call's first delta has its index, id, type
    and name; then only argument fragments, which concatenate to the plain answer's
    arguments. How many fragments depends on the client's pace: the engine's outputs put
    while an earlier one waits for the client are merged into it, as vLLM's are (the
    parsers' own tests feed token by token and count them: tool_parsers/
    test_streamed_arguments.py)."""
    arguments = '{"city": "Oslo", "days": 3}'
    running, text = (
        (server, f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>')
        if parser == "hermes"
        else (llama_server, f'{{"name": "get_weather", "parameters": {arguments}}}')
    )
    kwargs = {"tool_choice": "auto", "max_tokens": 150, "extra_body": {"guided_choice": [text]}}
    plain = running.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, **kwargs
    )
    (want,) = plain.choices[0].message.tool_calls
    deltas = []
    finish = None
    for chunk in running.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, stream=True, **kwargs
    ):
        for c in chunk.choices:
            assert not c.delta.content
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id.startswith("chatcmpl-tool-")
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert any(d.function.arguments for d in rest)
    streamed = "".join(d.function.arguments or "" for d in deltas)
    assert streamed == want.function.arguments == arguments
    assert finish == "tool_calls"
