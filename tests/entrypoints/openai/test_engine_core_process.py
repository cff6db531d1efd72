"""The server with its engine core in a process of its own (`--engine-core-process`).

A representative set of the server's tests runs again over this mode (imported below;
their `server` is this module's): completions, streaming, stop strings, n, logprobs,
chat streaming, 400s answered by the front, /health, /metrics and clients that
disconnect mid-stream. Then what only this mode has: a core that dies fails the requests
in flight and turns /health to 503, and the core process is gone after shutdown and
after the server process is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.entrypoints.openai.test_api_server import (  # noqa: F401 - re-run in this mode
    test_health_and_version,
    test_metrics_count_tokens_latencies_and_graph_runs,
)
from tests.entrypoints.openai.test_chat import (  # noqa: F401
    test_streamed_chat_sends_role_first_then_content_then_finish,
)
from tests.entrypoints.openai.test_completions import (  # noqa: F401
    test_greedy_completion_has_text_usage_and_length_finish,
    test_logprobs_have_one_entry_per_token_with_top_alternatives,
    test_n_gives_n_choices_each_with_its_own_index,
    test_stop_string_ends_the_text_before_it,
    test_streamed_text_equals_plain_text,
)
from tests.entrypoints.openai.test_errors import (  # noqa: F401
    http,
    test_bad_completion_fields_are_400_naming_the_field,
    test_prompt_longer_than_context_is_400,
    test_server_still_serves_after_bad_requests,
    test_token_ids_outside_the_vocabulary_are_400,
)
from tests.entrypoints.openai.test_load import (  # noqa: F401
    test_clients_that_disconnect_mid_stream_free_their_blocks,
)
from tests.utils.processes import free_port_pair, gone
from tests.utils.server import (
    CHAT_TEMPLATE,
    RunningServer,
    make_engine,
    start_server,
    wait_for_health,
)


@pytest.fixture(scope="module")
def server(stories_dir: Path) -> Iterator[RunningServer]:
    """The conftest's main server, its engine core in a process of its own."""
    running = start_server(
        make_engine(stories_dir, engine_core_process=True), chat_template=CHAT_TEMPLATE
    )
    yield running
    running.stop()


def test_greedy_text_equals_the_thread_modes(server: RunningServer, stories_dir: Path) -> None:
    """The same engine stepped in this process (LLMEngine, core in-process) gives the
    text the server gives with its core in another process."""
    from decodegraph.sampling_params import SamplingParams

    prompt = "Lily and Ben went to the park. They saw"
    reply = server.client().completions.create(
        model=server.model_name, prompt=prompt, max_tokens=24, temperature=0.0
    )
    engine = make_engine(stories_dir)
    try:
        engine.add_request("r", prompt, SamplingParams(max_tokens=24, temperature=0.0))
        text = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
    finally:
        engine.shutdown()
    assert reply.choices[0].text == text


def test_a_dead_core_fails_requests_in_flight_and_health_is_503(stories_dir: Path) -> None:
    running = start_server(make_engine(stories_dir, engine_core_process=True))
    core = running.async_llm.engine.engine_core
    try:
        assert httpx.get(f"{running.base_url}/health", timeout=10).status_code == 200
        failed: list[BaseException] = []
        streaming = threading.Event()

        def stream_long() -> None:
            try:
                chunks = running.client().completions.create(
                    model=running.model_name,
                    prompt="Once upon a time",
                    max_tokens=400,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for _ in chunks:
                    streaming.set()
            except (openai.APIError, httpx.HTTPError) as e:
                failed.append(e)
            streaming.set()

        reader = threading.Thread(target=stream_long)
        reader.start()
        assert streaming.wait(60)
        os.kill(core.pid, signal.SIGKILL)
        reader.join(timeout=60)
        assert not reader.is_alive(), "the request in flight hangs after the core died"
        assert failed, "the stream ended as if nothing happened"
        wait_for_health(running.base_url, 503, 10, "/health still 200 after the core died")
        reply = httpx.post(
            f"{running.base_url}/v1/completions",
            json={"model": running.model_name, "prompt": "Once", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code >= 500 and "error" in reply.json()
    finally:
        running.stop()


def test_the_core_process_is_gone_after_shutdown(stories_dir: Path) -> None:
    running = start_server(make_engine(stories_dir, engine_core_process=True))
    pid = running.async_llm.engine.engine_core.pid
    assert psutil.pid_exists(pid)
    running.stop()
    assert gone([pid], within_s=15)


def test_the_core_process_dies_with_a_killed_server(stories_dir: Path) -> None:
    port = free_port_pair()
    cmd = [sys.executable, "-m", "decodegraph.entrypoints.cli", "serve", str(stories_dir),
           "--port", str(port), "--enforce-eager", "--num-gpu-blocks-override", "128",
           "--uvicorn-log-level", "warning", "--engine-core-process"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.3)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert children, "no engine core process under the server"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert gone(children, within_s=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tensor_parallel_2_under_a_core_process_answers_as_the_engine_thread(
    stories_dir: Path,
) -> None:
    """`serve --engine-core-process -tp 2` (the mp executor: the core process starts
    the two ranks): completions and streamed chat through the openai client give the
    greedy text of the same TP 2 server with its core on the engine thread; the core
    and its ranks are gone after shutdown."""
    prompts = ["Lily and Ben went to the park. They saw", "Once upon a time"]
    messages = [{"role": "user", "content": "Tell me a story"}]

    def answers(running: RunningServer) -> tuple[list[str], str]:
        client = running.client()
        out = client.completions.create(
            model=running.model_name, prompt=prompts, max_tokens=24, temperature=0.0
        )
        chunks = client.chat.completions.create(
            model=running.model_name,
            messages=messages,
            max_tokens=16,
            temperature=0.0,
            stream=True,
        )
        chat = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)], chat

    results = []
    for core_process in (False, True):
        engine = make_engine(
            stories_dir,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            max_model_len=128,
            engine_core_process=core_process,
        )
        running = start_server(engine, chat_template=CHAT_TEMPLATE)
        try:
            if core_process:
                core = psutil.Process(engine.engine_core.pid)
                ranks = [p.pid for p in core.children(recursive=True)]
                assert len(ranks) >= 2, "the core process starts the ranks"
            results.append(answers(running))
        finally:
            running.stop()
    assert results[1] == results[0]
    assert all(results[0][0]) and results[0][1]
    assert gone([core.pid, *ranks], within_s=20)
