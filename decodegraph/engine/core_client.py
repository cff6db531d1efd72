"""`EngineCoreClient`: the front's end of an `EngineCore` in its own process.

It spawns the core process (engine/core_proc.py) and waits until it is ready; then it
offers `EngineCore`'s calls: `add_request` and `finish_requests` are buffered and sent
together by `flush` (one pickled message per flush, however many requests), outputs
come back one step per message. `get_output` is the synchronous way (flush, then wait for
the next step's outputs: `LLMEngine.step`); `AsyncLLM` instead waits on `output_conn`
itself beside its own command queue, and reads whatever arrived with `read_messages`.

The core dies with this process (its input closes, PR_SET_PDEATHSIG and a pid watch);
a core that died, or reported a failed step, makes `check_health` raise
`EngineDeadError`, and so does every later call.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import threading
import weakref
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from decodegraph.config import EngineConfig
from decodegraph.core.sched_output import EngineCoreOutput
from decodegraph.engine.core import EngineCoreRequest, EngineDeadError, EngineStats
from decodegraph.engine.core_proc import (
    CoreProcArgs,
    EngineCoreOutputs,
    EngineCoreReady,
    run_engine_core,
)
from decodegraph.executor.mp_ranks import stop_processes
from decodegraph.request import RequestStatus

logger = logging.getLogger(__name__)

# Loading, profiling and capturing can take minutes on a large model.
STARTUP_TIMEOUT_S = 1800.0
# A core told to shut down has this long to stop its workers before it is terminated.
SHUTDOWN_GRACE_S = 10.0


class EngineCoreClient:
    """Drive an `EngineCore` that runs in a spawned process of its own."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")
        core_input, self._input = ctx.Pipe(duplex=False)
        self.output_conn, core_output = ctx.Pipe(duplex=False)
        args = CoreProcArgs(
            config=config,
            input_conn=core_input,
            output_conn=core_output,
            parent_pid=os.getpid(),
            use_pdeathsig=threading.current_thread() is threading.main_thread(),
            log_level=logging.getLogger().getEffectiveLevel(),
        )
        self.process: BaseProcess = ctx.Process(
            target=run_engine_core, args=(args,), name="decodegraph-engine-core"
        )
        self.process.start()
        # Only the core holds its ends now: either side's exit closes the other's pipe.
        core_input.close()
        core_output.close()
        self._finalizer = weakref.finalize(self, _stop, self.process, self._input)
        atexit.register(self._finalizer)
        self._pending: list[tuple] = []
        self.dead: str | None = None
        try:
            ready = self._wait_ready()
        except BaseException:
            self._finalizer()
            raise
        self.pid = ready.pid
        self.graph_mode_name: str = ready.graph_mode
        self.stats: EngineStats = ready.stats
        logger.info("engine core in process %d (graph mode %s)", ready.pid, ready.graph_mode)

    def _wait_ready(self) -> EngineCoreReady:
        conn = self.output_conn
        if not wait([conn, self.process.sentinel], STARTUP_TIMEOUT_S):
            raise RuntimeError(f"the engine core did not start within {STARTUP_TIMEOUT_S} s")
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(
                f"the engine core process exited during start-up (exit code "
                f"{self.process.exitcode})"
            ) from None
        if kind == "error":
            raise RuntimeError(f"the engine core failed to start: {payload}")
        return payload

    # ---------------------------------------------------------------- requests in

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a sequence for the core (sent by the next `flush`)."""
        self._pending.append(("add", request))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish sequences in the core (sent by the next `flush`)."""
        self._pending.append(("finish", list(request_ids), status))

    def request_stats(self) -> None:
        """Ask for exact stats: the reply is a message with `num_stats_replies` 1."""
        self._pending.append(("stats",))

    def flush(self) -> None:
        """Send everything queued since the last flush, in order, as one message."""
        if not self._pending:
            return
        ops, self._pending = self._pending, []
        self._check_alive()
        try:
            self._input.send_bytes(pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL))
        except (EOFError, OSError) as e:
            self._died(f"its pipe closed ({e!r})")

    # ---------------------------------------------------------------- outputs out

    def read_messages(self) -> list[EngineCoreOutputs]:
        """Every message that has arrived, without waiting; `stats` updated."""
        messages = []
        conn = self.output_conn
        try:
            while conn.poll():
                messages.append(self._take(pickle.loads(conn.recv_bytes())))
        except (EOFError, OSError):
            self._died(f"the process exited (exit code {self.process.exitcode})")
        return messages

    def get_output(self) -> list[EngineCoreOutput]:
        """Flush, then wait for the next step's outputs (`EngineCore.get_output`'s
        synchronous counterpart)."""
        self.flush()
        while True:
            self._check_alive()
            wait([self.output_conn, self.process.sentinel])
            outputs = [o for m in self.read_messages() for o in m.outputs]
            if outputs:
                return outputs
            if not self.process.is_alive() and not self.output_conn.poll():
                self._died(f"the process exited (exit code {self.process.exitcode})")

    def _take(self, message: EngineCoreOutputs) -> EngineCoreOutputs:
        if message.error is not None:
            self._died(message.error)
        if message.stats is not None:
            self.stats = message.stats
        return message

    def get_stats(self) -> EngineStats:
        """The latest stats the core sent."""
        return self.stats

    # ---------------------------------------------------------------- health

    def check_health(self) -> None:
        """Raise EngineDeadError once the core reported a failure or its process ended."""
        self._check_alive()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine core failed: {self.dead}")
        if not self.process.is_alive():
            self._died(f"the process exited (exit code {self.process.exitcode})")

    def _died(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            logger.error("engine core process %s: %s", self.process.pid, why)
        raise EngineDeadError(f"the engine core failed: {self.dead}")

    def shutdown(self) -> None:
        """Stop the core process and its workers, and wait for it (idempotent)."""
        self._finalizer()


def _stop(process: BaseProcess, input_conn: Connection) -> None:
    if process.is_alive():
        try:
            input_conn.send_bytes(pickle.dumps([("shutdown",)]))
        except (EOFError, OSError):
            pass
    input_conn.close()  # a core that missed the message sees its input close
    stop_processes([process], SHUTDOWN_GRACE_S)
