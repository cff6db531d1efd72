"""POST /v1/chat/completions through the official `openai` client against a real server."""

from __future__ import annotations

import openai
import pytest

MODEL_NAME = "stories"  # the name the conftest servers serve
MESSAGES = [
    {"role": "system", "content": "Tell a story."},
    {"role": "user", "content": "Once upon a time"},
]


def test_chat_completion_answers_as_assistant_with_usage(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10


def test_chat_prompt_is_the_rendered_template(
    client: openai.OpenAI, server, chat_template: str
) -> None:
    """The chat reply equals a completion of the template's rendering of the messages."""
    rendered = server.async_llm.engine.apply_chat_template(
        MESSAGES, add_generation_prompt=True, chat_template=chat_template
    )
    assert rendered.endswith("assistant:")
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0.0
    )
    completion = client.completions.create(
        model=MODEL_NAME, prompt=rendered, max_tokens=12, temperature=0.0
    )
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens


def test_streamed_chat_sends_role_first_then_content_then_finish(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=15, temperature=0.0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=15, temperature=0.0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_streamed_chat_usage_chunk_comes_last(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=5,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens > 0


def test_chat_n_and_seed_are_reproducible(client: openai.OpenAI) -> None:
    def run() -> list[str]:
        out = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=12,
            n=2,
            temperature=1.0,
            seed=42,
            extra_body={"ignore_eos": True},
        )
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]

    first = run()
    assert len(first) == 2
    assert run() == first


def test_chat_stop_string(client: openai.OpenAI) -> None:
    full = (
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0.0
        )
        .choices[0]
        .message.content
    )
    stop = full.strip().split()[1]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0.0, stop=stop
    )
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_list_top_alternatives_per_token(client: openai.OpenAI, stream: bool) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    choices = [c.choices[0] for c in resp if c.choices] if stream else resp.choices
    content = [t for c in choices if c.logprobs is not None for t in c.logprobs.content]
    assert len(content) == 5
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        # Greedy: the sampled token is the best alternative.
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)
        assert token.bytes == list(token.token.encode())


def test_chat_without_logprobs_has_none(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0.0
    )
    assert out.choices[0].logprobs is None
