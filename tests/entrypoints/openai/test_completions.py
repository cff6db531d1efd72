"""POST /v1/completions through the official `openai` client against a real server."""

from __future__ import annotations

import openai
import pytest

PROMPT = "Once upon a time"
MODEL_NAME = "stories"  # the name the conftest servers serve


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_greedy_completion_has_text_usage_and_length_finish(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.text
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.model == MODEL_NAME


def test_greedy_completion_is_deterministic(client: openai.OpenAI) -> None:
    texts = {
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0.0)
        .choices[0]
        .text
        for _ in range(2)
    }
    assert len(texts) == 1


def test_same_seed_gives_same_text_and_other_seed_differs(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL_NAME,
                prompt=PROMPT,
                max_tokens=24,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_streamed_text_equals_plain_text(client: openai.OpenAI) -> None:
    plain = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0.0
    )
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0.0, stream=True
        )
    )
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_stream_include_usage_adds_a_final_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_n_gives_n_choices_each_with_its_own_index(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=10,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 30
    assert len({c.text for c in out.choices}) > 1


def test_streamed_n_reaches_every_index(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=3, stream=True
        )
    )
    finished = {c.choices[0].index for c in chunks if c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_list_of_prompts_and_token_ids_map_to_choice_indices(client: openai.OpenAI, server) -> None:
    ids = server.async_llm.tokenizer.encode(PROMPT)
    single = (
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0)
        .choices[0]
        .text
    )
    out = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "The cat"], max_tokens=8, temperature=0.0, n=2
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == single
    from_ids = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0.0
    )
    assert from_ids.choices[0].text == single
    two = client.completions.create(
        model=MODEL_NAME, prompt=[ids, ids], max_tokens=8, temperature=0.0
    )
    assert [c.text for c in two.choices] == [single, single]


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    plain = (
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0)
        .choices[0]
        .text
    )
    echoed = (
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0, echo=True
        )
        .choices[0]
        .text
    )
    assert echoed == PROMPT + plain


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0.0)
        .choices[0]
        .text
    )
    stop = full.strip().split()[2]
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0.0, stop=[stop]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert stop not in choice.text
    assert full.startswith(choice.text)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_have_one_entry_per_token_with_top_alternatives(
    client: openai.OpenAI, stream: bool
) -> None:
    resp = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.0,
        logprobs=3,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    choices = [c.choices[0] for c in resp] if stream else resp.choices
    tokens, token_lps, tops, offsets, text = [], [], [], [], ""
    for choice in choices:
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            token_lps += choice.logprobs.token_logprobs
            tops += choice.logprobs.top_logprobs
            offsets += choice.logprobs.text_offset
    assert len(tokens) == len(token_lps) == len(tops) == len(offsets) == 6
    # The engine decodes each logprob token alone, which drops SentencePiece's leading
    # space; the tokens still spell the text once spaces are set aside.
    assert "".join(tokens).replace(" ", "") == text.replace(" ", "")
    assert offsets[0] == 0
    assert all(offsets[i + 1] == offsets[i] + len(tokens[i]) for i in range(5))
    for lp, top in zip(token_lps, tops, strict=True):
        assert lp <= 0.0
        assert 3 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert lp == pytest.approx(max(top.values()))


def test_a_multi_step_server_streams_bursts_that_join_to_single_step_text(
    client: openai.OpenAI, stories_dir
) -> None:
    """`--num-scheduler-steps 5` with the engine core in its own process: streamed
    chunks carry up to 5 tokens each and join to the single-step server's text; a stop
    string inside a burst ends the text where it ends token by token."""
    from tests.utils.server import make_engine, start_server

    multi = start_server(make_engine(stories_dir, engine_core_process=True, num_scheduler_steps=5))
    try:
        other = multi.client()
        body = {"ignore_eos": True}
        for stop in (None, [" the"]):
            kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0.0)
            want = client.completions.create(**kwargs, stop=stop, extra_body=body).choices[0]
            plain = other.completions.create(**kwargs, stop=stop, extra_body=body).choices[0]
            chunks = list(
                other.completions.create(**kwargs, stop=stop, extra_body=body, stream=True)
            )
            assert (plain.text, plain.finish_reason) == (want.text, want.finish_reason)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
            assert chunks[-1].choices[0].finish_reason == want.finish_reason
            assert len(chunks) < 40 // 2
        assert want.finish_reason == "stop"  # the stop string ended it
        # Logprobs of every token of every burst, aligned with the text.
        chunks = list(
            other.completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=23, temperature=0.0, logprobs=2,
                stream=True, extra_body=body,
            )
        )  # fmt: skip
        tokens = sum((c.choices[0].logprobs.tokens for c in chunks if c.choices), [])
        assert len(tokens) == 23 and "".join(tokens) == "".join(c.choices[0].text for c in chunks)
    finally:
        multi.stop()
