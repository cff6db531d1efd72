"""`EngineCoreProc`: the `EngineCore` in a process of its own (vLLM's name).

`EngineCoreClient` (engine/core_client.py) spawns it; the front (the `LLMEngine` with
its tokenizer and output processor, the server) stays in its own process, so the
core's Python (scheduling, the step, sampling) no longer shares a GIL with the event
loop. Everything the executor starts (tensor-parallel workers) is started here and
dies with this process.

The busy loop: while the scheduler has work it steps, taking whatever input arrived
before each step without waiting for any; when idle it blocks on its input (waking
once a second to check the workers, so a worker that died while idle is reported).
Each step's outputs leave as one pickled `EngineCoreOutputs`, written by an output
thread: the loop never blocks on a full pipe, so a front blocked in sending to it (a
large batch of prompts) always gets read.

Input: one pickled list of operations per flush of the front, applied in order:
`("add", EngineCoreRequest)`, `("finish", request_ids, RequestStatus)`, `("stats",)`
(answered by the next message's `stats`, counted in `num_stats_replies`) and
`("shutdown",)`. The process ends when its input closes (the front is gone), when its
parent dies, on SIGTERM, or after a failed step (reported first, in `error`).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from decodegraph.config import EngineConfig
from decodegraph.core.sched_output import EngineCoreOutput
from decodegraph.engine.core import EngineCore, EngineStats

logger = logging.getLogger(__name__)

# Stats ride along with the outputs at most this often while busy, and always on going
# idle (the figures behind /metrics).
STATS_INTERVAL_S = 0.05
# How often an idle core checks that its workers are alive.
IDLE_HEALTH_CHECK_S = 1.0


@dataclass(slots=True)
class EngineCoreOutputs:
    """One message from the core: a step's outputs, and what else it has to say."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # The core's stats, now (sent with a step's outputs now and then, on going idle, and
    # in answer to ("stats",)).
    stats: EngineStats | None = None
    # How many ("stats",) requests this message answers (its `stats` is their answer).
    num_stats_replies: int = 0
    # Set once the core failed (a step raised, a worker died); nothing follows.
    error: str | None = None


@dataclass
class EngineCoreReady:
    """The core's first message, once its workers are loaded and captured."""

    pid: int
    graph_mode: str
    stats: EngineStats


@dataclass
class CoreProcArgs:
    """What the spawned core process needs (pickled into it)."""

    config: EngineConfig
    input_conn: Connection  # the front's operations come in here
    output_conn: Connection  # EngineCoreOutputs go out here
    parent_pid: int
    use_pdeathsig: bool
    log_level: int


def run_engine_core(args: CoreProcArgs) -> None:
    """The core process's entry point: build the core, say so, then run the loop."""
    from decodegraph.executor.mp_ranks import die_with_parent

    die_with_parent(args.parent_pid, args.use_pdeathsig)
    # Ctrl-C reaches the whole process group: the front decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    logging.basicConfig(level=args.log_level, format="%(levelname)s core %(name)s: %(message)s")
    out = args.output_conn
    try:
        core = _build_core(args.config)
    except BaseException as e:  # noqa: BLE001 - the front shows the traceback
        out.send(("error", f"{e!r}\n{traceback.format_exc()}"))
        out.close()
        raise SystemExit(1) from None
    try:
        out.send(("ready", EngineCoreReady(os.getpid(), core.graph_mode.name, core.get_stats())))
        EngineCoreProc(core, args.input_conn, out).run_busy_loop()
    finally:
        core.shutdown()


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _build_core(config: EngineConfig) -> EngineCore:
    """What `LLMEngine` builds for an in-process core, here: the platform, the seed, the
    tokenizer and grammar compiler the workers sample grammars with, and the core."""
    import torch

    from decodegraph.engine.llm_engine import make_structured_output
    from decodegraph.platforms import get_platform
    from decodegraph.tokenizer import get_tokenizer

    mc = config.model_config
    platform = get_platform(config.device_config.device)
    platform.check_and_update_config(config)
    torch.manual_seed(mc.seed)
    tokenizer = get_tokenizer(mc, mc.model_path)
    return EngineCore(config, platform, make_structured_output(config, tokenizer))


class EngineCoreProc:
    """Steps an `EngineCore` while it has work, fed and read over two pipes."""

    def __init__(self, core: EngineCore, input_conn: Connection, output_conn: Connection):
        self.core = core
        self.input_conn = input_conn
        self._sends: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._sender = threading.Thread(
            target=_send_loop, args=(output_conn, self._sends), name="core-output", daemon=True
        )
        self._stats_replies = 0
        self._last_stats_time = 0.0
        self._stopped = False

    def run_busy_loop(self) -> None:
        """Run until shut down, the front goes away or a step fails."""
        self._sender.start()
        core, conn = self.core, self.input_conn
        try:
            while not self._stopped:
                if not core.has_unfinished_requests():
                    while not conn.poll(IDLE_HEALTH_CHECK_S):
                        core.check_health()
                while conn.poll():
                    self._handle(pickle.loads(conn.recv_bytes()))
                if self._stopped:
                    break
                outputs = core.get_output() if core.has_unfinished_requests() else []
                self._send(outputs)
        except (EOFError, OSError):
            logger.info("the front closed its pipe: the core stops")
        except Exception as e:  # noqa: BLE001 - a failed step (or health check) ends the core
            logger.exception("the engine core failed")
            self._sends.put(pickle.dumps(EngineCoreOutputs(error=f"{e!r}")))
        finally:
            self._sends.put(None)
            self._sender.join(10.0)

    def _handle(self, ops: list[tuple]) -> None:
        core = self.core
        for op in ops:
            kind = op[0]
            if kind == "add":
                core.add_request(op[1])
            elif kind == "finish":
                core.finish_requests(op[1], op[2])
            elif kind == "stats":
                self._stats_replies += 1
            elif kind == "shutdown":
                self._stopped = True
                return

    def _send(self, outputs: list[EngineCoreOutput]) -> None:
        """Queue a message with `outputs` and, when due, the stats."""
        now = time.monotonic()
        stats = None
        if (
            self._stats_replies
            or not self.core.has_unfinished_requests()
            or now - self._last_stats_time >= STATS_INTERVAL_S
        ):
            stats = self.core.get_stats()
            self._last_stats_time = now
        if not outputs and stats is None:
            return
        message = EngineCoreOutputs(outputs, stats, self._stats_replies)
        self._stats_replies = 0
        # Pickled here, before the scheduler's next step can touch what it refers to.
        self._sends.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _send_loop(conn: Connection, sends: queue.SimpleQueue[bytes | None]) -> None:
    while (data := sends.get()) is not None:
        try:
            conn.send_bytes(data)
        except (EOFError, OSError):
            return  # the front is gone; the loop sees its input close
    conn.close()
