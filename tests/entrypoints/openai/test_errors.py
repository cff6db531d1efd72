"""Bad input gets a 4xx with the OpenAI error body, never a 500, and the server lives on."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

MODEL_NAME = "stories"  # the name the conftest servers serve


def assert_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c


def test_malformed_json_is_400(http: httpx.Client) -> None:
    resp = http.post(
        "/v1/completions",
        content=b'{"model": "stories", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert "JSON" in assert_error(resp, 400)["message"]


def test_non_object_body_is_400(http: httpx.Client) -> None:
    assert_error(http.post("/v1/chat/completions", json=[1, 2, 3]), 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL_NAME}, "prompt"),
        ({"model": MODEL_NAME, "prompt": "a", "max_tokens": "many"}, "max_tokens"),
        ({"model": MODEL_NAME, "prompt": "a", "temperature": -1}, "temperature"),
        ({"model": MODEL_NAME, "prompt": "a", "top_p": 2}, "top_p"),
        ({"model": MODEL_NAME, "prompt": "a", "n": 0}, "n"),
        ({"model": MODEL_NAME, "prompt": "a", "logprobs": 50}, "logprobs"),
        ({"model": MODEL_NAME, "prompt": "a", "seed": 2**70}, "seed"),
        ({"model": MODEL_NAME, "prompt": "a", "top_k": -5}, "top_k"),
        ({"model": MODEL_NAME, "prompt": "a", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
        ({"model": MODEL_NAME, "prompt": "a", "stop": [""]}, "stop"),
        ({"model": MODEL_NAME, "prompt": []}, "prompt"),
        ({"model": MODEL_NAME, "prompt": [[]]}, "prompt"),
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(
    http: httpx.Client, body: dict, param: str
) -> None:
    assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL_NAME, "messages": []}, "messages"),
        ({"model": MODEL_NAME, "messages": [{"content": "hi"}]}, "messages"),
        (
            {
                "model": MODEL_NAME,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ],
            },
            "messages",
        ),
        (
            {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "hi"}],
                "top_logprobs": 3,
            },
            "top_logprobs",
        ),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(
    http: httpx.Client, body: dict, param: str
) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_prompt_longer_than_context_is_400(client: openai.OpenAI, server) -> None:
    max_len = server.async_llm.model_config.max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[5] * (max_len + 10), max_tokens=4)
    assert info.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=MODEL_NAME, prompt="tale " * (2 * max_len), max_tokens=4, stream=True
        )


def test_token_ids_outside_the_vocabulary_are_400(client: openai.OpenAI) -> None:
    for bad in ([1, 10**6], [1, -3]):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL_NAME, prompt=bad, max_tokens=2)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-9", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )


def test_unknown_route_and_wrong_method_use_the_error_body(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_oversized_body_is_413(guarded_server) -> None:
    headers = {"Authorization": f"Bearer {guarded_server.api_key}"}
    big = {"model": MODEL_NAME, "prompt": "x" * (200 * 1024)}
    with httpx.Client(base_url=guarded_server.base_url, timeout=30, headers=headers) as http:
        assert_error(http.post("/v1/completions", json=big), 413)

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must still hold
            yield b'{"model": "stories", "prompt": "'
            for _ in range(100):
                yield b"y" * 4096
            yield b'"}'

        assert_error(
            http.post(
                "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
            ),
            413,
        )


def test_wrong_or_missing_api_key_is_401(guarded_server) -> None:
    with pytest.raises(openai.AuthenticationError):
        guarded_server.client(api_key="wrong").models.list()
    with httpx.Client(base_url=guarded_server.base_url, timeout=30) as http:
        assert_error(http.get("/v1/models"), 401)
        # Health and metrics stay open for probes and scrapers.
        assert http.get("/health").status_code == 200
    models = guarded_server.client(api_key=guarded_server.api_key).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_chat_without_a_template_is_a_clear_400(guarded_server) -> None:
    client = guarded_server.client(api_key=guarded_server.api_key)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert "--chat-template" in info.value.body["message"]


def test_server_still_serves_after_bad_requests(http: httpx.Client, client: openai.OpenAI) -> None:
    for _ in range(3):
        http.post("/v1/completions", content=b"{{{", headers={"content-type": "application/json"})
        http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [1, 10**6]})
    assert http.get("/health").status_code == 200
    out = client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=3)
    assert out.usage.completion_tokens >= 1
