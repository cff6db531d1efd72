"""Structured outputs through the official `openai` client against a real server on
stories260K, sampled at temperature 1 with several seeds, plain and streamed, in graph
modes FULL_DECODE_ONLY and NONE.

stories260K writes stories: its 512-token vocabulary has byte fallback, so every JSON
character is producible, but left to itself it never closes a free string. The schemas
here bound their strings and the server limits whitespace (disable_any_whitespace), so
every output finishes within max_tokens; json_object cannot be bounded, so its outputs
are checked to parse when the grammar ends them and to be a valid JSON prefix when
max_tokens cuts them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import xgrammar as xgr

from decodegraph.sampling_params import StructuredOutputsParams
from tests.utils.server import CHAT_TEMPLATE, MODEL_NAME, RunningServer, make_engine, start_server

SEEDS = [0, 1, 2]
# n=3 children sample with seeds seed, seed+1, seed+2 in one batch of three rows.
N = 3
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["happy", "sad", "sleepy"]
MESSAGES = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module", params=["FULL_DECODE_ONLY", "NONE"])
def server(request: pytest.FixtureRequest, stories_dir: Path) -> Iterator[RunningServer]:
    mode = request.param
    graphs = {"cudagraph_mode": mode}
    if mode != "NONE":
        # Inductor off keeps capture quick; masking happens outside the graph either way.
        graphs.update(cudagraph_capture_sizes=[1, 2, 4], use_inductor=False)
    engine = make_engine(
        stories_dir,
        enforce_eager=False,
        compilation_config=graphs,
        max_num_seqs=4,
        max_model_len=256,
        structured_outputs_config={"disable_any_whitespace": True},
    )
    running = start_server(engine, chat_template=CHAT_TEMPLATE)
    yield running
    running.stop()


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


def _check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age", "pet"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 8
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 99
    assert person["pet"] in ("cat", "dog", "bird")


def _chat_texts(client: openai.OpenAI, stream: bool, **kwargs) -> list[tuple[str, str]]:
    """(text, finish_reason) of each of the N choices."""
    common = {"model": MODEL_NAME, "messages": MESSAGES, "n": N, "temperature": 1.0}
    if not stream:
        out = client.chat.completions.create(**common, **kwargs)
        return [(c.message.content, c.finish_reason) for c in out.choices]
    texts, finish = [""] * N, [""] * N
    for chunk in client.chat.completions.create(**common, stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return list(zip(texts, finish, strict=True))


def _completion_texts(client: openai.OpenAI, stream: bool, **kwargs) -> list[tuple[str, str]]:
    common = {"model": MODEL_NAME, "prompt": "Once upon a time", "n": N, "temperature": 1.0}
    if not stream:
        out = client.completions.create(**common, **kwargs)
        return [(c.text, c.finish_reason) for c in sorted(out.choices, key=lambda c: c.index)]
    texts, finish = [""] * N, [""] * N
    for chunk in client.completions.create(**common, stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return list(zip(texts, finish, strict=True))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("seed", SEEDS)
def test_chat_json_schema_response_format_always_parses(
    client: openai.OpenAI, seed: int, stream: bool
) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for text, finish in _chat_texts(
        client, stream, seed=seed, max_tokens=60, response_format=response_format
    ):
        assert finish == "stop", text
        _check_person(text)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_guided_json_and_structured_outputs_json_parse(
    client: openai.OpenAI, stream: bool
) -> None:
    for body in ({"guided_json": PERSON}, {"structured_outputs": {"json": PERSON}}):
        for text, finish in _completion_texts(
            client, stream, seed=7, max_tokens=60, extra_body=body
        ):
            assert finish == "stop", text
            _check_person(text)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("seed", SEEDS)
def test_regex_and_choice_outputs_always_match(
    client: openai.OpenAI, seed: int, stream: bool
) -> None:
    for body in ({"structured_outputs": {"regex": EMAIL}}, {"guided_regex": EMAIL}):
        for text, finish in _completion_texts(
            client, stream, seed=seed, max_tokens=40, extra_body=body
        ):
            assert finish == "stop" and re.fullmatch(EMAIL, text), text
    for body in ({"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}):
        for text, finish in _chat_texts(client, stream, seed=seed, max_tokens=10, extra_body=body):
            assert finish == "stop" and text in CHOICES, text


def test_grammar_output_is_a_sentence_of_the_grammar(client: openai.OpenAI) -> None:
    grammar = (
        'root ::= "The " animal " is " mood\nanimal ::= "cat" | "dog"\nmood ::= "happy" | "sad"'
    )
    for body in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}):
        for text, finish in _completion_texts(
            client, False, seed=3, max_tokens=20, extra_body=body
        ):
            assert finish == "stop"
            assert re.fullmatch(r"The (cat|dog) is (happy|sad)", text), text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_parses_when_finished_and_is_a_json_prefix_when_cut(
    client: openai.OpenAI, server: RunningServer, seed: int, stream: bool
) -> None:
    manager = server.async_llm.engine.structured_output
    compiled = manager.compile(StructuredOutputsParams(json_object=True))
    for text, finish in _chat_texts(
        client, stream, seed=seed, max_tokens=40, response_format={"type": "json_object"}
    ):
        assert text.startswith("{"), text
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert finish == "length"
            assert xgr.GrammarMatcher(compiled).accept_string(text), text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_that_the_model_closes_parses(
    client: openai.OpenAI, server: RunningServer, seed: int, stream: bool
) -> None:
    """Left to itself stories260K does not close a json_object within its context (so the
    test above checks prefixes only; docs/performance.md, "json_object"). A logit
    bias towards "}" and '"' (which the grammar still masks where they are invalid)
    makes it close them: then the grammar's end is an EOS, finish_reason "stop", and
    the text one JSON object, streamed or not."""
    tokenizer = server.async_llm.tokenizer
    bias = {str(tokenizer.convert_tokens_to_ids("<0x7D>")): 20}  # "}"
    for quote in ("<0x22>", '"', '▁"'):
        bias[str(tokenizer.convert_tokens_to_ids(quote))] = 4
    manager = server.async_llm.engine.structured_output
    compiled = manager.compile(StructuredOutputsParams(json_object=True))
    outputs = _chat_texts(
        client,
        stream,
        seed=seed,
        max_tokens=60,
        logit_bias=bias,
        response_format={"type": "json_object"},
    )
    finished = [text for text, finish in outputs if finish == "stop"]
    assert finished, outputs  # the parse below runs
    for text in finished:
        assert isinstance(json.loads(text), dict), text
    for text, finish in outputs:
        assert finish in ("stop", "length")
        assert xgr.GrammarMatcher(compiled).accept_string(text), text


def test_greedy_choice_is_masked_beside_a_free_greedy_request(
    client: openai.OpenAI, server: RunningServer
) -> None:
    """All-greedy batches take the full decode graph's fused argmax unless a row has a
    grammar: the masked request still answers a choice, its neighbour its free text."""
    import concurrent.futures

    def ask(body: dict) -> str:
        out = client.completions.create(
            model=MODEL_NAME,
            prompt="Once upon a time",
            max_tokens=12,
            temperature=0.0,
            extra_body=body or {"ignore_eos": True},
        )
        return out.choices[0].text

    free_alone = ask({})
    before = server.async_llm.get_stats_sync().graph_runs
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, {"guided_choice": CHOICES}) for _ in range(2)]
        futures += [pool.submit(ask, {}) for _ in range(2)]
        texts = [f.result() for f in futures]
    assert all(t in CHOICES for t in texts[:2]), texts
    assert texts[2:] == [free_alone] * 2
    after = server.async_llm.get_stats_sync().graph_runs
    mode = server.async_llm.engine.config.compilation_config.cudagraph_mode.name
    if mode == "FULL_DECODE_ONLY":
        assert after.get("FULL", 0) > before.get("FULL", 0)
