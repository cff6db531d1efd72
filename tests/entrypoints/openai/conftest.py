"""Real uvicorn servers on loopback, serving stories260K, for the OpenAI API tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.utils.server import (
    API_KEY,
    CHAT_TEMPLATE,
    RunningServer,
    make_engine,
    start_server,
)


@pytest.fixture(scope="session")
def server(stories_dir: Path) -> Iterator[RunningServer]:
    """The main test server: stories260K with a chat template, no API key."""
    running = start_server(make_engine(stories_dir), chat_template=CHAT_TEMPLATE)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def guarded_server(stories_dir: Path) -> Iterator[RunningServer]:
    """A server with an API key, no chat template and a small body limit."""
    running = start_server(
        make_engine(stories_dir), api_key=API_KEY, max_request_body_bytes=64 * 1024
    )
    yield running
    running.stop()


@pytest.fixture(scope="session")
def fuzz_server(stories_dir: Path) -> Iterator[RunningServer]:
    """A server with a chat template and a 64-token context, so fuzzed requests end fast."""
    running = start_server(make_engine(stories_dir, max_model_len=64), chat_template=CHAT_TEMPLATE)
    yield running
    running.stop()


@pytest.fixture
def engine_factory(stories_dir: Path) -> Callable[..., Any]:
    """Make a fresh engine on stories260K with the servers' settings (for offline runs)."""
    return lambda **overrides: make_engine(stories_dir, **overrides)


@pytest.fixture
def chat_template() -> str:
    return CHAT_TEMPLATE


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()
