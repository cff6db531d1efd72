"""Bounded load on loopback: 64 concurrent streaming clients, several hundred requests.

Every request completes, greedy text equals the offline engine's, and no KV block leaks,
also when clients disconnect mid-stream.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from tests.utils.requests import greedy

MODEL_NAME = "stories"  # the name the conftest servers serve
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Ben went to the park. They saw",
    "One day, a big bird",
    "Tom had a red ball.",
    "The sun was hot and",
    "Mom said",
    "There was a small house near the river. In the house lived",
]
CONCURRENCY = 64
NUM_REQUESTS = 320
MAX_TOKENS = 16


def _offline(engine, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """Greedy text of each prompt from a separate engine driven by hand (the offline API)."""
    params = greedy(max_tokens, ignore_eos=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    texts: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[prompts[int(out.request_id)]] = out.outputs[0].text
    return texts


async def _stream_one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, int]:
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, tokens = "", "", 0
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, finish, tokens


async def _run_clients(server) -> list[tuple[str, str, str, int]]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(NUM_REQUESTS):
        queue.put_nowait(PROMPTS[i % len(PROMPTS)])
    results: list[tuple[str, str, str, int]] = []
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, timeout=120) as http:
        client = server.async_client(http_client=http)

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                results.append((prompt, *await _stream_one(client, prompt)))

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CONCURRENCY))), 120)
    return results


def test_64_streaming_clients_all_complete_match_offline_and_free_every_block(
    server, engine_factory
) -> None:
    start = time.monotonic()
    results = asyncio.run(_run_clients(server))
    elapsed = time.monotonic() - start
    assert len(results) == NUM_REQUESTS
    expected = _offline(engine_factory(), PROMPTS, MAX_TOKENS)
    for prompt, text, finish, tokens in results:
        assert finish in ("stop", "length")
        assert tokens >= 1
        assert text == expected[prompt], prompt
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_blocks
    print(f"{NUM_REQUESTS} requests at concurrency {CONCURRENCY} in {elapsed:.1f} s")


async def _disconnect_mid_stream(server, n: int) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:

        async def read_a_little() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                seen = 0
                async for line in resp.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        return  # leaving the block closes the connection mid-stream

        async def give_up_on_plain() -> None:
            # A non-streaming client that times out: its request must be aborted too.
            try:
                await http.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
            except httpx.TimeoutException:
                return

        await asyncio.gather(*(read_a_little() for _ in range(n)), give_up_on_plain())


def test_clients_that_disconnect_mid_stream_free_their_blocks(server) -> None:
    before = server.wait_idle()
    asyncio.run(_disconnect_mid_stream(server, 16))
    stats = server.wait_idle(timeout=10)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks
    # Aborted, not run to the end: far fewer than 17 * 400 tokens were generated.
    generated = stats.generation_tokens_total - before.generation_tokens_total
    assert generated < 17 * 400 // 2
