"""vLLM's endpoints and answers beyond the completions: /tokenize, /detokenize,
/v1/models/{id}, /ping, /tokenizer_info; 400s naming fields that cannot be honoured
(never a silent 200); continuous usage stats; one log line for a client that leaves."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.utils.server import RunningServer, make_engine, start_server

MODEL_NAME = "stories"
PROMPT = "Once upon a time"
# A chat template that renders a message's name.
NAMED_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}{% if m.get('name') %} ({{ m['name'] }}){% endif %}"
    ": {{ m['content'] }}\n{% endfor %}"
)


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def info_server(stories_dir: Path) -> Iterator[RunningServer]:
    running = start_server(
        make_engine(stories_dir),
        enable_tokenizer_info_endpoint=True,
        chat_template=NAMED_TEMPLATE,
    )
    yield running
    running.stop()


def test_tokenize_and_detokenize_round_trip(http: httpx.Client, server: RunningServer) -> None:
    tokenizer = server.async_llm.tokenizer
    r = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode(PROMPT)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.async_llm.model_config.max_model_len
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    bare = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tokenizer.encode("user: hi\nassistant:", add_special_tokens=False)
    back = http.post("/detokenize", json={"tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    bad = http.post("/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong_model = http.post("/tokenize", json={"prompt": "x", "model": "nope"})
    assert wrong_model.status_code == 404


def test_models_retrieve(client: openai.OpenAI) -> None:
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_ping_answers_get_and_post(http: httpx.Client) -> None:
    assert http.get("/ping").status_code == 200
    assert http.post("/ping").status_code == 200


def test_tokenizer_info_only_when_enabled(http: httpx.Client, info_server: RunningServer) -> None:
    assert http.get("/tokenizer_info").status_code == 404  # off by default, as in vLLM
    info = httpx.get(f"{info_server.base_url}/tokenizer_info").json()
    assert info["tokenizer_class"]
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"best_of": 2}, "best_of"),
        ({"suffix": "the end"}, "suffix"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt_logprobs": 50}, "prompt_logprobs"),
    ],
)
def test_completion_fields_that_cannot_be_honoured_are_400(
    http: httpx.Client, fields: dict, param: str
) -> None:
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_best_of_equal_to_n_is_accepted(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, n=2, best_of=2)
    assert len(out.choices) == 2


def test_max_tokens_past_the_context_is_vllms_400(
    client: openai.OpenAI, server: RunningServer
) -> None:
    limit = server.async_llm.model_config.max_model_len
    n = len(server.async_llm.tokenizer.encode(PROMPT))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=limit)
    message = e.value.body["message"]
    assert "'max_tokens' or 'max_completion_tokens' is too large" in message
    assert f"maximum context length is {limit} tokens" in message
    assert f"({limit} > {limit} - {n})" in message
    # Exactly the rest of the context is fine.
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=limit - n)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=limit
        )


@pytest.mark.parametrize(
    "fields", [{"audio": {"voice": "alloy"}}, {"modalities": ["audio"]}, {"prediction": {}}]
)
def test_chat_fields_that_cannot_be_honoured_are_400(http: httpx.Client, fields: dict) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == next(iter(fields))


def test_continuous_usage_stats_in_every_chunk(client: openai.OpenAI) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=5,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
    )
    with_text = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in with_text]
    # Cumulative: a chunk may carry several tokens (outputs that piled up behind a busy
    # client are merged), but every chunk counts all sent so far.
    assert counts == sorted(set(counts)) and counts[0] >= 1 and counts[-1] == 5
    assert chunks[-1].usage.completion_tokens == 5
    chat = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
    )
    usages = [c.usage.completion_tokens for c in chat if c.choices and c.usage is not None]
    assert usages and usages[-1] == 4
    assert chat[-1].usage.completion_tokens == 4


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_that_leaves_is_one_log_line(server: RunningServer) -> None:
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "decodegraph", "")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        body = {"prompt": ["hi"] * 16, "max_tokens": 400, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.2)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
            "went away" in r.getMessage() for r in handler.records
        ):
            time.sleep(0.05)
        server.wait_idle()
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
    seen = {id(r): r for r in handler.records}.values()
    gone = [r for r in seen if "went away" in r.getMessage()]
    assert len(gone) == 1 and "\n" not in gone[0].getMessage()
    assert not [r for r in seen if r.exc_info or r.levelno >= logging.ERROR]


def test_chat_message_name_reaches_the_template(info_server: RunningServer) -> None:
    messages = [{"role": "user", "name": "bob", "content": "hi"}, {"role": "user", "content": "yo"}]
    r = httpx.post(f"{info_server.base_url}/tokenize", json={"messages": messages})
    tokenizer = info_server.async_llm.tokenizer
    want = tokenizer.encode("user (bob): hi\nuser: yo\n", add_special_tokens=False)
    assert r.json()["tokens"] == want
    info = httpx.get(f"{info_server.base_url}/tokenizer_info").json()
    assert info["chat_template"] == NAMED_TEMPLATE
