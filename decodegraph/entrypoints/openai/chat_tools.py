"""Tool calling in chat: checking `tools` / `tool_choice`, the structured output that
enforces "required" and a named function, and the `tool_calls` of replies and streams.

tool_choice, as vLLM serves it:
- "none": plain text (the template still sees the tools);
- "auto": the model may call tools; `--tool-call-parser` finds the calls in its text
  (needs `--enable-auto-tool-choice`);
- "required": the output is a JSON list of `{"name", "parameters"}` objects, one of the
  tools each, enforced by a JSON schema; finish_reason "tool_calls";
- a named function: the output is that function's arguments, enforced by its parameters
  schema; finish_reason is the output's own ("stop").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from decodegraph.entrypoints.openai.serving_engine import OpenAIError
from decodegraph.entrypoints.openai.structured_outputs import StructuredOutputSpec
from decodegraph.entrypoints.openai.tool_parsers import PartialToolCall, ToolParser
from decodegraph.entrypoints.openai.tool_protocol import (
    ChatCompletionNamedToolChoiceParam,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    ToolFields,
    random_tool_call_id,
)
from decodegraph.structured_output.params import StructuredOutputsParams

# A tool without a parameters schema takes any object.
_ANY_OBJECT = {"type": "object"}
_STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def required_tools_schema(request: ToolFields) -> dict:
    """A JSON list of calls, each `{"name": one tool's name, "parameters": its schema}`."""
    assert request.tools
    items = []
    defs: dict = {}
    for t in request.tools:
        parameters = dict(t.function.parameters or _ANY_OBJECT)
        # A tool's "#/$defs/..." references point at its own root, which is nested
        # here: its definitions move up to the list's root, where they then resolve.
        defs.update(parameters.pop("$defs", None) or {})
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if defs:
        schema["$defs"] = defs
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


class ChatTools:
    """One chat request's tool handling; the constructor answers a bad combination with
    vLLM's 400."""

    def __init__(self, request: ToolFields, enable_auto_tools: bool, parser: ToolParser | None):
        self.request = request
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if request.tools else "none"
        self.choice = choice
        self.named: str | None = None
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            self.named = choice.function.name
        if choice != "none" and not request.tools:
            raise OpenAIError(
                "tool_choice: When using `tool_choice`, `tools` must be set.", 400, "tool_choice"
            )
        if choice == "auto" and not (enable_auto_tools and parser is not None):
            raise OpenAIError(
                'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                400,
                "tool_choice",
            )
        if self.named is not None and self.named not in {t.function.name for t in request.tools}:
            raise OpenAIError(
                f"tool_choice: the named function {self.named!r} is not in tools",
                400,
                "tool_choice",
            )
        if self.enforced:
            given = [n for n in _STRUCTURED_FIELDS if getattr(request, n, None) is not None]
            if given:
                raise OpenAIError(
                    f"tool_choice: {choice if isinstance(choice, str) else 'a named function'} "
                    f"is enforced through structured outputs and cannot be combined with "
                    f"{given[0]}",
                    400,
                    "tool_choice",
                )
        self.parser = parser if choice == "auto" else None

    @property
    def enforced(self) -> bool:
        """tool_choice "required" or a named function: a grammar makes the calls."""
        return self.choice == "required" or self.named is not None

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template gets them (OpenAI's dicts)."""
        if not self.request.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.request.tools]

    def structured_outputs(self) -> StructuredOutputSpec | None:
        """The structured output that enforces "required" or a named function."""
        if self.named is not None:
            tool = next(t for t in self.request.tools if t.function.name == self.named)
            schema = tool.function.parameters or _ANY_OBJECT
        elif self.choice == "required":
            schema = required_tools_schema(self.request)
        else:
            return None
        try:
            params = StructuredOutputsParams(json=schema)
        except ValueError as e:
            raise OpenAIError(f"tools: {e}", 400, "tools") from None
        return StructuredOutputSpec(params=params, field="tools")

    def message(self, text: str) -> tuple[str | None, list[ToolCall], bool]:
        """A finished choice's content, tool calls, and whether finish_reason becomes
        "tool_calls"."""
        if self.named is not None:
            return "", [ToolCall(function=FunctionCall(name=self.named, arguments=text))], False
        if self.choice == "required":
            calls = _required_calls(text)
            return ("", calls, True) if calls else (text, [], False)
        if self.parser is not None:
            info = self.parser.extract_tool_calls(text)
            if info.tools_called:
                return info.content, info.tool_calls, True
        return text, [], False

    def stream(self) -> ToolStream:
        return ToolStream(self)


def _required_calls(text: str) -> list[ToolCall]:
    try:
        calls = json.loads(text)
        return [
            ToolCall(
                function=FunctionCall(
                    name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False)
                )
            )
            for c in calls
        ]
    except (ValueError, KeyError, TypeError):
        return []  # cut short by max_tokens: the text goes back as content


_DECODER = json.JSONDecoder()


def _complete_required_calls(text: str) -> list[ToolCall]:
    """The calls whose objects are complete in a "required" list still being written."""
    pos = text.find("[") + 1
    if pos == 0:
        return []
    calls = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ","):
            pos += 1
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
            arguments = json.dumps(obj["parameters"], ensure_ascii=False)
            calls.append(ToolCall(function=FunctionCall(name=obj["name"], arguments=arguments)))
        except (ValueError, KeyError, TypeError):
            return calls


@dataclass
class ToolDelta:
    """What one streamed output of a choice adds."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class ToolStream:
    """One streamed choice: turns each new piece of text into content and tool-call
    deltas. A call found by a parser (auto) goes out as vLLM's parsers send it: a first
    delta with its index, id, type and name once the name is known, then its arguments
    in fragments that concatenate to the plain answer's arguments (parser
    `stream_calls`); calls in a "required" list go out whole, one delta each, once their
    JSON is complete; a named function's arguments go out as they come."""

    def __init__(self, tools: ChatTools) -> None:
        self.tools = tools
        self.text = ""
        self.content_sent = 0
        self.calls_sent = 0
        self.named_id: str | None = None
        self.called = False
        # Per auto call streamed so far: its id and the arguments sent.
        self.streamed: list[tuple[str, str]] = []

    def feed(self, delta_text: str, finished: bool) -> ToolDelta:
        self.text += delta_text
        tools = self.tools
        if tools.named is not None:
            return self._named(delta_text)
        if tools.choice == "required":
            out = ToolDelta(tool_calls=self._whole(_complete_required_calls(self.text)))
            if finished and not self.called:
                out.content = self.text  # cut short before its first call was complete
            return out
        parser = tools.parser
        if parser is None:
            return ToolDelta(content=delta_text)
        end = len(self.text) if finished else parser.content_end(self.text)
        info = parser.extract_tool_calls(self.text, final=finished)
        out = ToolDelta()
        if info.tools_called:
            end = len(info.content or "")
        elif finished:
            end = len(self.text)
        if self.called:
            end = self.content_sent  # what follows a call is never content
        if end > self.content_sent:
            out.content = self.text[self.content_sent : end]
            self.content_sent = end
        out.tool_calls = self._incremental(parser.stream_calls(self.text, finished))
        return out

    def _incremental(self, calls: list[PartialToolCall]) -> list[DeltaToolCall]:
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self.streamed):
                call_id = random_tool_call_id()
                function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
                deltas.append(
                    DeltaToolCall(index=index, id=call_id, type="function", function=function)
                )
                self.streamed.append((call_id, call.arguments))
                self.called = True
                continue
            call_id, sent = self.streamed[index]
            # A call's arguments so far only ever grow (partial_json.py).
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                fragment = DeltaFunctionCall(arguments=call.arguments[len(sent) :])
                deltas.append(DeltaToolCall(index=index, function=fragment))
                self.streamed[index] = (call_id, call.arguments)
        return deltas

    def _named(self, delta_text: str) -> ToolDelta:
        if self.named_id is None:
            self.named_id = random_tool_call_id()
            function = DeltaFunctionCall(name=self.tools.named, arguments=delta_text)
            call = DeltaToolCall(index=0, id=self.named_id, type="function", function=function)
            return ToolDelta(tool_calls=[call])
        if not delta_text:
            return ToolDelta()
        return ToolDelta(
            tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta_text))]
        )

    def _whole(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        new = calls[self.calls_sent :]
        deltas = [
            DeltaToolCall(
                index=self.calls_sent + i,
                id=c.id,
                type="function",
                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments),
            )
            for i, c in enumerate(new)
        ]
        self.calls_sent = len(calls)
        if deltas:
            self.called = True
        return deltas


def template_tool_fields(message: object) -> dict:
    """A message's tool fields as chat templates read them: an assistant's `tool_calls`
    with their arguments as objects (as vLLM hands them over), a tool's `tool_call_id`."""
    out: dict = {}
    calls = getattr(message, "tool_calls", None)
    if calls:
        fixed = []
        for call in calls:
            call = dict(call)
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                except ValueError:
                    pass  # the template gets the text as sent
            call["function"] = function
            fixed.append(call)
        out["tool_calls"] = fixed
    tool_call_id = getattr(message, "tool_call_id", None)
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    return out
