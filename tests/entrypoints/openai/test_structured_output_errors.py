"""An invalid schema, regex, grammar or choice is a 400 naming the field the client
sent, and the server keeps serving everyone else."""

from __future__ import annotations

import openai
import pytest

MODEL_NAME = "stories"
MESSAGES = [{"role": "user", "content": "Once upon a time"}]

BAD_CHAT = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "foo"}},
            }
        },
        "response_format.json_schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema",
    ),
    (
        {
            "extra_body": {
                "guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
            }
        },
        "guided_json",
    ),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"json": {"type": "foo"}}}}, "structured_outputs.json"),
    ({"extra_body": {"structured_outputs": {}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_CHAT)
def test_bad_chat_spec_is_400_naming_the_field(
    client: openai.OpenAI, kwargs: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, **kwargs)
    body = info.value.body
    assert body["param"] == param, body
    assert body["message"].startswith(param), body
    assert body["type"] == "BadRequestError" and body["code"] == 400


def test_bad_completion_spec_is_400_and_others_are_served(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=4, extra_body={"guided_regex": "(("}
        )
    assert info.value.body["param"] == "guided_regex"
    out = client.completions.create(
        model=MODEL_NAME, prompt="Once", max_tokens=4, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert out.choices[0].text in ("yes", "no")
    plain = client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=4)
    assert plain.choices[0].text


def test_text_response_format_changes_nothing(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0.0}
    plain = client.chat.completions.create(**kwargs)
    text = client.chat.completions.create(**kwargs, response_format={"type": "text"})
    assert plain.choices[0].message.content == text.choices[0].message.content
