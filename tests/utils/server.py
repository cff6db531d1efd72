"""Real uvicorn servers on loopback over a real engine, for the server's tests and the
serving benchmark's."""

from __future__ import annotations

import argparse
import dataclasses
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

from decodegraph.engine.async_llm import AsyncLLM
from decodegraph.entrypoints.openai.api_server import build_app

MODEL_NAME = "stories"
API_KEY = "test-secret-key"
# stories260K has no chat template; this one renders "role: content" lines.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_engine(model_dir: Path, *, engine_core_process: bool = False, **overrides: Any) -> Any:
    """A real `LLMEngine` on stories260K, eager and with a small KV cache by default; its
    core in a process of its own with `engine_core_process`."""
    from decodegraph.engine.arg_utils import EngineArgs
    from decodegraph.engine.llm_engine import LLMEngine

    wanted = {
        "model": str(model_dir),
        "served_model_name": MODEL_NAME,
        "enforce_eager": True,
        "num_gpu_blocks_override": 512,
        "seed": 0,
    }
    wanted.update(overrides)
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    return LLMEngine.from_engine_args(
        EngineArgs(**{k: v for k, v in wanted.items() if k in known}),
        engine_core_process=engine_core_process,
    )


@dataclass
class RunningServer:
    """A uvicorn server on a background thread and the engine behind it."""

    base_url: str
    async_llm: AsyncLLM
    server: uvicorn.Server
    thread: threading.Thread
    model_name: str = MODEL_NAME
    api_key: str | None = None

    def client(self, api_key: str = "unused", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=60, **kw
        )

    def async_client(self, api_key: str = "unused", **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=60, **kw
        )

    def wait_idle(self, timeout: float = 20.0) -> Any:
        """Wait until the engine holds no request; return its stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.async_llm.get_stats_sync()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.async_llm.shutdown()


def wait_for_health(base_url: str, status: int, within_s: float, why: str) -> None:
    """Poll /health until it answers `status`; fail with `why` after `within_s`."""
    deadline = time.monotonic() + within_s
    while httpx.get(f"{base_url}/health", timeout=10).status_code != status:
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def start_server(engine: Any, **args: Any) -> RunningServer:
    """Serve `engine` on a free loopback port; return once it accepts connections."""
    async_llm = AsyncLLM(engine)
    namespace = argparse.Namespace(
        **{"served_model_name": MODEL_NAME, "api_key": None, "chat_template": None, **args}
    )
    app = build_app(async_llm, namespace)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{port}"
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            async_llm.shutdown()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return RunningServer(
        f"http://127.0.0.1:{port}",
        async_llm,
        server,
        thread,
        namespace.served_model_name,
        namespace.api_key,
    )
