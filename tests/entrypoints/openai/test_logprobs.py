"""Logprobs through the official `openai` client against a real server: echo with the
prompt's logprobs (equal to transformers'), max_tokens=0 with echo, vLLM's
prompt_logprobs field, token texts that concatenate to the text with offsets into it,
unique top-k keys, token_id:N, chat bytes, logit_bias."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import torch

from tests.utils.reference import transformers_logprobs
from tests.utils.server import CHAT_TEMPLATE, RunningServer, make_engine, start_server

PROMPT = "Once upon a time, there was a little girl named Lily."
MODEL_NAME = "stories"


@pytest.fixture(scope="module")
def reference(stories_dir: Path) -> Callable[[list[int]], torch.Tensor]:
    """transformers' log-softmax over the vocabulary at every position of a prompt."""
    return transformers_logprobs(stories_dir)


@pytest.fixture(scope="module")
def token_id_server(stories_dir: Path) -> Iterator[RunningServer]:
    """A server started with --return-tokens-as-token-ids."""
    running = start_server(
        make_engine(stories_dir), chat_template=CHAT_TEMPLATE, return_tokens_as_token_ids=True
    )
    yield running
    running.stop()


def _ids(server: RunningServer, text: str) -> list[int]:
    return server.async_llm.tokenizer.encode(text)


def test_echo_with_logprobs_returns_the_prompt_logprobs_of_transformers(
    client: openai.OpenAI, server: RunningServer, reference: Callable
) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True, logprobs=3
    )
    choice = out.choices[0]
    ids = _ids(server, PROMPT)
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(ids)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert len(lp.top_logprobs[p]) in (3, 4)
        assert max(lp.top_logprobs[p].values()) == pytest.approx(ref[p - 1].max().item(), abs=1e-4)
    # Tokens concatenate to the text; each offset indexes its token in it.
    assert "".join(lp.tokens) == choice.text
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert choice.text[offset : offset + len(token)] == token


def test_echo_with_max_tokens_zero_returns_only_the_prompt(
    client: openai.OpenAI, server: RunningServer
) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    )
    choice = out.choices[0]
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == len(_ids(server, PROMPT))
    assert "".join(choice.logprobs.tokens) == PROMPT
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT


def test_max_tokens_zero_without_echo_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_prompt_logprobs_field_has_vllm_shape(
    client: openai.OpenAI, server: RunningServer, reference: Callable
) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    pl = out.choices[0].model_extra["prompt_logprobs"]
    ids = _ids(server, PROMPT)
    ref = reference(ids)
    assert len(pl) == len(ids) and pl[0] is None
    for p in range(1, len(ids)):
        entry = pl[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert entry["rank"] >= 1 and entry["decoded_token"]
        assert {v["rank"] for k, v in pl[p].items() if k != str(ids[p])} <= {1, 2}
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    chat_pl = chat.model_extra["prompt_logprobs"]
    assert chat_pl[0] is None and all(len(e) == 1 for e in chat_pl[1:])


def test_generated_tokens_keep_spaces_and_offsets_index_the_text(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24, logprobs=20)
        if stream:
            chunks = list(client.completions.create(**kwargs, temperature=0.0, stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            tokens = [
                t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
            ]
            offsets = [
                o
                for c in chunks
                if c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset
            ]
            tops = [
                t
                for c in chunks
                if c.choices[0].logprobs
                for t in c.choices[0].logprobs.top_logprobs
            ]
        else:
            choice = client.completions.create(**kwargs, temperature=0.0).choices[0]
            text, lp = choice.text, choice.logprobs
            tokens, offsets, tops = lp.tokens, lp.text_offset, lp.top_logprobs
        assert any(t.startswith(" ") for t in tokens)  # SentencePiece's leading spaces
        if not text.endswith(tokens[-1]):  # an EOS piece is "" and not in the text
            assert tokens[-1] == ""
        assert "".join(tokens) == text
        for token, offset in zip(tokens, offsets, strict=True):
            assert text[offset : offset + len(token)] == token
        # 20 alternatives plus the sampled token: 20 or 21 distinct keys at every step.
        assert all(len(top) in (20, 21) for top in tops)


def test_return_tokens_as_token_ids(token_id_server: RunningServer, stories_dir: Path) -> None:
    client = token_id_server.client()
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=2, echo=True
    )
    lp = out.choices[0].logprobs
    ids = _ids(token_id_server, PROMPT)
    assert lp.tokens[: len(ids)] == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs[1:] for k in top)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": False},
    )
    assert not chat.choices[0].logprobs.content[0].token.startswith("token_id:")


def test_chat_tokens_and_bytes_are_the_tokens_own(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=16,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
    )
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 5
        assert len({top.token for top in t.top_logprobs}) == 5


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, server: RunningServer) -> None:
    forced = 300
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.0,
        logprobs=0,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert out.choices[0].logprobs.tokens == [f"token_id:{forced}"] * 4
    plain = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0.0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    first = plain.choices[0].logprobs.tokens[0]
    banned = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0.0,
        logprobs=0,
        logit_bias={first.split(":")[1]: -100},
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert banned.choices[0].logprobs.tokens[0] != first
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, logit_bias={"100000": 1})
    assert e.value.body["param"] == "logit_bias"


def test_chat_bytes_of_a_byte_token_are_its_own_byte(server: RunningServer) -> None:
    from decodegraph.entrypoints.openai.logprobs import LogprobFormatter

    tokenizer = server.async_llm.tokenizer
    fmt = LogprobFormatter(tokenizer)
    byte_ids = [
        t
        for t in tokenizer.encode("☃", add_special_tokens=False)
        if tokenizer.convert_ids_to_tokens(t).startswith("<0x")
    ]
    assert [fmt.token_bytes(t, "") for t in byte_ids] == [[b] for b in "☃".encode()]
    assert fmt.token_bytes(byte_ids[0], "bytes:\\xe2") == [0xE2]
    assert fmt.token_bytes(tokenizer.encode("there")[-1], " there") == list(b" there")


def test_echo_logprobs_for_every_choice_and_prompt(
    client: openai.OpenAI, server: RunningServer
) -> None:
    prompts = [PROMPT, "The cat sat"]
    for stream in (False, True):
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=prompts,
            n=2,
            max_tokens=3,
            temperature=1.0,
            seed=3,
            echo=True,
            logprobs=1,
            stream=stream,
        )
        tokens: dict[int, list[str]] = {}
        texts: dict[int, str] = {}
        for chunk in out if stream else [out]:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                if choice.logprobs is not None:
                    tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
        assert sorted(texts) == [0, 1, 2, 3]
        for index, text in texts.items():
            prompt = prompts[index // 2]
            assert text.startswith(prompt)
            assert len(tokens[index]) >= len(_ids(server, prompt))
            assert "".join(tokens[index]) == text


def test_top_logprob_keys_stay_distinct_when_texts_collide(server: RunningServer) -> None:
    from decodegraph.entrypoints.openai.logprobs import LogprobFormatter
    from decodegraph.entrypoints.openai.protocol import CompletionLogProbs
    from decodegraph.outputs import Logprob

    tokenizer = server.async_llm.tokenizer
    fmt = LogprobFormatter(tokenizer)
    a = tokenizer.convert_tokens_to_ids("a")
    byte_a = tokenizer.convert_tokens_to_ids("<0x61>")
    other = tokenizer.convert_tokens_to_ids("▁the")
    entry = {
        a: Logprob(-0.1, 1, "a"),
        byte_a: Logprob(-2.0, 2, "a"),
        other: Logprob(-3.0, 3, "a"),  # any other token whose piece collides
    }
    out = CompletionLogProbs()
    fmt.extend_completion(out, [a], [entry], 3, 0)
    assert out.top_logprobs[0] == {"a": -0.1, "bytes:\\x61": -2.0, f"token_id:{other}": -3.0}


def test_echo_of_a_token_prompt_is_its_text(client: openai.OpenAI, server: RunningServer) -> None:
    ids = _ids(server, PROMPT)  # BOS first
    out = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=0
    )
    choice = out.choices[0]
    assert choice.text == PROMPT
    assert "".join(choice.logprobs.tokens) == PROMPT


@pytest.fixture(scope="module")
def whole_vocab_server(stories_dir: Path) -> Iterator[RunningServer]:
    """A server started with --max-logprobs -1 (no cap: -1 asks for every token)."""
    running = start_server(make_engine(stories_dir, max_logprobs=-1), chat_template=CHAT_TEMPLATE)
    yield running
    running.stop()


def test_minus_one_beyond_the_default_max_logprobs_is_400(client: openai.OpenAI) -> None:
    """vLLM's answers: -1 means the whole vocabulary, which the default max_logprobs (20)
    does not allow; below -1 is invalid; completions' `logprobs` takes no -1."""
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    cases = [
        ("prompt_logprobs", lambda: client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": -1})),
        ("prompt_logprobs", lambda: client.chat.completions.create(
            **chat, extra_body={"prompt_logprobs": -1})),
        ("prompt_logprobs", lambda: client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": -2})),
        ("logprobs", lambda: client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=1, logprobs=-1)),
        ("logprobs", lambda: client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=1, logprobs=21)),
        ("top_logprobs", lambda: client.chat.completions.create(
            **chat, logprobs=True, top_logprobs=-2)),
    ]  # fmt: skip
    for param, call in cases:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param, (param, e.value.body)


def test_minus_one_returns_every_token_with_max_logprobs_minus_one(
    whole_vocab_server: RunningServer, reference: Callable
) -> None:
    client = whole_vocab_server.client()
    vocab = whole_vocab_server.async_llm.engine.vocab_size
    ids = _ids(whole_vocab_server, PROMPT)
    ref = reference(ids)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0.0,
        echo=True,
        logprobs=2,
        extra_body={"prompt_logprobs": -1},
    )
    choice = out.choices[0]
    pl = choice.model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for p in range(1, len(ids)):
        assert len(pl[p]) == vocab
        got = torch.tensor([pl[p][str(t)]["logprob"] for t in range(vocab)])
        torch.testing.assert_close(got, ref[p - 1].float(), atol=1e-4, rtol=0)
    # echo's top_logprobs keep the request's own count: 2 besides the token.
    assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0.0,
        logprobs=True,
        top_logprobs=-1,
        extra_body={"prompt_logprobs": -1},
    )
    assert all(len(e) == vocab for e in chat.model_extra["prompt_logprobs"][1:])
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == vocab for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)


def test_streamed_prompt_logprobs_come_once_in_the_first_chunk_with_output(
    client: openai.OpenAI,
) -> None:
    """vLLM refuses prompt_logprobs with stream=True (a 400); here a stream carries
    them once, as the plain answer has them: chat's at the top of the first chunk after
    the role, completions' on each choice's first chunk."""
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "temperature": 0.0}
    plain = client.chat.completions.create(**chat, extra_body={"prompt_logprobs": 2})
    chunks = list(
        client.chat.completions.create(**chat, stream=True, extra_body={"prompt_logprobs": 2})
    )
    carrying = [k for k, c in enumerate(chunks) if c.model_extra.get("prompt_logprobs")]
    assert carrying == [1], carrying  # chunk 0 is the role's, sent before any output
    assert chunks[1].model_extra["prompt_logprobs"] == plain.model_extra["prompt_logprobs"]
    assert chunks[1].choices[0].delta.content  # with the first token's text
    assert all("prompt_logprobs" not in c.model_extra for k, c in enumerate(chunks) if k != 1)
    without = client.chat.completions.create(**chat, stream=True)
    assert all("prompt_logprobs" not in c.model_extra for c in without)  # as vLLM's chunks

    kwargs = {"model": MODEL_NAME, "prompt": [PROMPT, "The cat"], "max_tokens": 3, "n": 2}
    whole = client.completions.create(**kwargs, temperature=0.0, extra_body={"prompt_logprobs": 1})
    first: dict[int, object] = {}
    for chunk in client.completions.create(
        **kwargs, temperature=0.0, stream=True, extra_body={"prompt_logprobs": 1}
    ):
        for choice in chunk.choices:
            pl = choice.model_extra.get("prompt_logprobs")
            if choice.index in first:
                assert pl is None, "sent once per choice"
            else:
                first[choice.index] = pl
    assert sorted(first) == [0, 1, 2, 3]
    for choice in whole.choices:
        assert first[choice.index] == choice.model_extra["prompt_logprobs"]
