"""`--tool-call-parser hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Hermes 2 Pro, Qwen 2.5 and later), text before the first call as content."""

from __future__ import annotations

import json
import re

from decodegraph.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    PartialToolCall,
    ToolParser,
    held_back,
    scan_call,
)
from decodegraph.entrypoints.openai.tool_protocol import FunctionCall, ToolCall

START, END = "<tool_call>", "</tool_call>"
# A closed call, or an unclosed one at the end of the text (a model that stopped early).
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesToolParser(ToolParser):
    def extract_tool_calls(
        self, model_output: str, final: bool = True
    ) -> ExtractedToolCallInformation:
        if START not in model_output:
            return ExtractedToolCallInformation(False, content=model_output)
        calls = []
        try:
            for closed, unclosed in _CALL.findall(model_output):
                if not closed and not final:
                    break  # the last call is still being written
                obj = json.loads(closed or unclosed)
                calls.append(_tool_call(obj))
        except (ValueError, KeyError, TypeError):
            if final:
                return ExtractedToolCallInformation(False, content=model_output)
        content = model_output[: model_output.find(START)]
        return ExtractedToolCallInformation(bool(calls) or not final, calls, content or None)

    def content_end(self, text: str) -> int:
        start = text.find(START)
        if start >= 0:
            return start
        return len(text) - held_back(text, START)

    def stream_calls(self, text: str, final: bool) -> list[PartialToolCall]:
        calls: list[PartialToolCall] = []
        start = text.find(START)
        while start >= 0:
            try:
                call = scan_call(text, start + len(START), ("arguments",), final)
            except ValueError:
                break
            calls.append(call)
            if not call.complete:
                break
            start = text.find(START, call.end)
        return calls


def _tool_call(obj: dict) -> ToolCall:
    arguments = obj.get("arguments", {})
    return ToolCall(
        function=FunctionCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False))
    )
