"""The request fields that ask for structured outputs, and their `StructuredOutputsParams`.

A request may use OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs` object (json, regex, choice, grammar, json_object), or vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields; at most one
of them. A bad spec is a 400 whose `param` is the field the client sent.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from decodegraph.structured_output.params import StructuredOutputsParams

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class JsonSchemaResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class StructuredOutputFields(BaseModel):
    """Mixed into the completion and chat requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class StructuredOutputSpec(NamedTuple):
    """What a request asks for, and the field it asked in (for error messages)."""

    params: StructuredOutputsParams
    field: str


def structured_outputs_of(request: StructuredOutputFields) -> StructuredOutputSpec | None:
    """The request's `StructuredOutputsParams` and the field that set them; ValueError
    whose message starts with the field when they are invalid or several are set."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = request.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise ValueError(
                "response_format.json_schema: a json_schema response format needs "
                "json_schema.schema"
            )
        found.append(("response_format.json_schema", {"json": rf.json_schema.json_schema}))
    so = request.structured_outputs
    if so is not None:
        kwargs = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object,
            "disable_any_whitespace": so.disable_any_whitespace,
        }
        found.append(("structured_outputs", kwargs))
    for name in _GUIDED:
        value = getattr(request, name)
        if value is not None:
            found.append((name, {name.removeprefix("guided_"): value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ValueError(f"{found[1][0]}: only one structured output may be given, got {names}")
    field, kwargs = found[0]
    try:
        params = StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise rename_field(e, field) from None
    return StructuredOutputSpec(params=params, field=field)


def rename_field(error: ValueError, field: str) -> ValueError:
    """`error` with its leading `structured_outputs...:` field replaced by `field` (the
    name the client used), keeping the sub-field for the structured_outputs object."""
    message = str(error)
    head, sep, rest = message.partition(":")
    if not sep or not head.startswith("structured_outputs"):
        return error
    if field == "structured_outputs":
        return ValueError(message)
    return ValueError(f"{field}:{rest}")


async def attach_structured_outputs(
    engine: Any, params: Any, spec: StructuredOutputSpec | None
) -> None:
    """Set `params.structured_outputs` from `spec` (see `structured_outputs_of`) and
    compile it off the event loop, so a bad spec is a 400 naming the client's field and
    the engine thread later finds the grammar in its cache."""
    # Here, not at the top: protocol.py imports this module and serving_engine imports it.
    from decodegraph.entrypoints.openai.serving_engine import OpenAIError

    if spec is None:
        return
    params.structured_outputs = spec.params
    try:
        await asyncio.to_thread(engine.structured_output.compile, spec.params)
    except ValueError as e:
        raise OpenAIError.from_value_error(rename_field(e, spec.field)) from None
