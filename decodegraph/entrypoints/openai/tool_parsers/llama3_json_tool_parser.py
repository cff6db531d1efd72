"""`--tool-call-parser llama3_json`: Llama 3.1/3.2's JSON tool calls, a text that is one
or more `{"name": ..., "parameters": {...}}` objects separated by `;`, optionally after
`<|python_tag|>`. Text that does not start so is content."""

from __future__ import annotations

import json

from decodegraph.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    PartialToolCall,
    ToolParser,
    scan_call,
)
from decodegraph.entrypoints.openai.tool_protocol import FunctionCall, ToolCall

BOT = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    def extract_tool_calls(
        self, model_output: str, final: bool = True
    ) -> ExtractedToolCallInformation:
        text = model_output.lstrip()
        if not (text.startswith(BOT) or text.startswith("{")):
            return ExtractedToolCallInformation(False, content=model_output)
        text = text.removeprefix(BOT)
        calls: list[ToolCall] = []
        pos = 0
        try:
            while True:
                pos = _skip_separators(text, pos)
                if pos >= len(text):
                    break
                obj, pos = _DECODER.raw_decode(text, pos)
                # The first of the two keys written, as stream_calls takes it.
                arguments = next((obj[k] for k in obj if k in ("arguments", "parameters")), {})
                calls.append(
                    ToolCall(
                        function=FunctionCall(
                            name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False)
                        )
                    )
                )
        except (ValueError, KeyError, TypeError, AttributeError):
            if final:
                return ExtractedToolCallInformation(False, content=model_output)
        return ExtractedToolCallInformation(bool(calls) or not final, calls, None)

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or BOT.startswith(stripped) or stripped.startswith(("{", BOT)):
            return 0  # may still be (or is) a tool call: hold it all
        return len(text)

    def stream_calls(self, text: str, final: bool) -> list[PartialToolCall]:
        text = text.lstrip()
        if not (text.startswith(BOT) or text.startswith("{")):
            return []
        text = text.removeprefix(BOT)
        calls: list[PartialToolCall] = []
        pos = _skip_separators(text, 0)
        while pos < len(text):
            try:
                # The first of the two keys written holds the arguments.
                call = scan_call(text, pos, ("arguments", "parameters"), final)
            except ValueError:
                break
            calls.append(call)
            if not call.complete:
                break
            pos = _skip_separators(text, call.end)
        return calls


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
        pos += 1
    return pos
