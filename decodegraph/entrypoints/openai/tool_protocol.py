"""Tool-call shapes of the OpenAI API as vLLM serves them: the request's `tools` and
`tool_choice`, and the `tool_calls` of replies and streamed deltas."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def random_tool_call_id() -> str:
    """A tool call's id, spelled as vLLM's."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionToolsParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(BaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class ToolFields(BaseModel):
    """Mixed into the chat request."""

    tools: list[ChatCompletionToolsParam] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = (
        None
    )
    parallel_tool_calls: bool | None = True


class FunctionCall(BaseModel):
    name: str
    # The arguments as JSON text.
    arguments: str


class ToolCall(BaseModel):
    id: str = Field(default_factory=random_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One tool call's part in a streamed chunk: its id, type and name come once, in
    its first delta; `arguments` text may follow in pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
