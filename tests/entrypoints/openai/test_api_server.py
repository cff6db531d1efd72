"""Health, version, metrics and the OpenAPI document of a real server."""

from __future__ import annotations

import re
import time

import httpx
import openai

MODEL_NAME = "stories"  # the name the conftest servers serve


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample in a text exposition."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in metrics")


def test_health_and_version(server) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    version = httpx.get(f"{server.base_url}/version").json()["version"]
    assert re.match(r"\d+\.\d+", version)


def test_openapi_document_lists_the_endpoints(server) -> None:
    doc = httpx.get(f"{server.base_url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health"):
        assert path in doc["paths"]


def test_metrics_count_tokens_latencies_and_graph_runs(server, client: openai.OpenAI) -> None:
    def scrape() -> str:
        # Poll /metrics alone (no engine call that could refresh the snapshot for us):
        # the gauges must fall back to idle by themselves once the request is done.
        deadline = time.monotonic() + 5
        while True:
            text = httpx.get(f"{server.base_url}/metrics").text
            idle = _sample(text, "decodegraph:num_requests_running") == 0
            if idle or time.monotonic() > deadline:
                return text
            time.sleep(0.02)

    before = scrape()
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=7,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    after = scrape()
    assert (
        _sample(after, "decodegraph:generation_tokens_total")
        - _sample(before, "decodegraph:generation_tokens_total")
        == 7
    )
    assert (
        _sample(after, "decodegraph:prompt_tokens_total")
        - _sample(before, "decodegraph:prompt_tokens_total")
        == out.usage.prompt_tokens
    )
    assert (
        _sample(after, "decodegraph:time_to_first_token_seconds_count")
        - _sample(before, "decodegraph:time_to_first_token_seconds_count")
        == 1
    )
    assert _sample(after, "decodegraph:inter_token_latency_seconds_count") > _sample(
        before, "decodegraph:inter_token_latency_seconds_count"
    )
    assert _sample(after, "decodegraph:num_requests_running") == 0
    assert _sample(after, "decodegraph:num_requests_waiting") == 0
    assert 0.0 <= _sample(after, "decodegraph:kv_cache_usage_perc") <= 1.0
    runs = [line for line in after.splitlines() if line.startswith("decodegraph:graph_runs_total{")]
    assert runs and sum(float(line.rsplit(" ", 1)[1]) for line in runs) > 0
    assert all('mode="' in line for line in runs)
