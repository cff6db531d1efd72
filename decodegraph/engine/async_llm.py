"""`AsyncLLM`: an asyncio front for the synchronous `LLMEngine`.

The engine is not thread-safe, so every engine call (add_request, abort_request, step,
get_stats) runs on one dedicated engine thread. The asyncio side posts commands to it
through a queue; the thread steps while there is work and sleeps on the queue when idle.
After each step it routes the outputs to per-request collectors through one mailbox per
event loop, which wakes its loop (`call_soon_threadsafe`) only when it was empty: a step
of 64 requests wakes the loop once, and steps that finish while the loop is still busy
with an earlier one do not wake it again. A collector merges the DELTA outputs that pile
up while its consumer is busy (as vLLM's `RequestOutputCollector`), so a consumer that
falls behind catches up with one chunk for several steps instead of one per step.

With the engine core in a process of its own (`LLMEngine(engine_core_process=True)`),
the engine thread does not step: it waits on the core's output pipe and on a wake-up
socket beside its command queue, sends the commands' requests and aborts to the core in
one message per wake-up, and runs the output processor on each step's outputs as they
arrive. The core steps by itself meanwhile, off this process's GIL.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from decodegraph.engine.core import EngineDeadError
from decodegraph.metrics import EngineMetrics
from decodegraph.outputs import RequestOutput
from decodegraph.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# Refresh the stats snapshot behind /metrics at most this often while busy.
_STATS_INTERVAL_S = 0.05
# Exceptions from add_request that mean "this request is bad", not "the engine is broken".
_BAD_REQUEST_ERRORS = (ValueError, TypeError, OverflowError)


class RequestOutputCollector:
    """A request's outputs on their way to its consumer, on the consumer's event loop.

    Anything else put here (the accept signal, an exception) queues as it comes; a
    DELTA output put while the previous one is still waiting is merged into it, and a
    CUMULATIVE one replaces it (it holds everything the earlier one did).
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self._merge = output_kind is not RequestOutputKind.FINAL_ONLY
        self._delta = output_kind is RequestOutputKind.DELTA
        self._items: deque[Any] = deque()
        self._ready = asyncio.Event()

    def put(self, item: Any) -> None:
        """Add an item (call on the consumer's loop)."""
        items = self._items
        if self._merge and items and isinstance(item, RequestOutput):
            last = items[-1]
            if isinstance(last, RequestOutput):
                if self._delta:
                    last.add(item)
                else:
                    items[-1] = item
                return
        items.append(item)
        self._ready.set()

    async def get(self) -> Any:
        """The next item, waiting for one if there is none."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class _Mailbox:
    """What the engine thread has for the collectors of one event loop, not yet taken.

    Every item for that loop goes through here, in order (an accept signal before the
    request's first output). Only a post to an empty mailbox wakes the loop; the one
    `drain` that wake-up schedules takes whatever has piled up by the time it runs.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weak, so that the loops' table of mailboxes does not keep closed loops alive.
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._items: list[tuple[_RequestStream, Any]] = []

    def post(self, items: Iterable[tuple[_RequestStream, Any]]) -> None:
        """Queue (stream, item) pairs for the loop's collectors (from any thread)."""
        with self._lock:
            wake = not self._items
            self._items.extend(items)
        if not wake:
            return
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("event loop is gone")
            loop.call_soon_threadsafe(self.drain)
        except RuntimeError:
            # That caller's loop is closed: nobody is listening any more.
            with self._lock:
                self._items.clear()

    def drain(self) -> None:
        """Hand everything posted so far to its collectors (on the loop)."""
        with self._lock:
            items, self._items = self._items, []
        for stream, item in items:
            stream.collector.put(item)


@dataclass(eq=False)
class _RequestStream:
    """One request's way back to its caller: a collector on the caller's event loop."""

    request_id: str
    mailbox: _Mailbox
    output_kind: RequestOutputKind
    arrival_time: float = field(default_factory=time.monotonic)
    collector: RequestOutputCollector = field(init=False)
    # Engine-thread bookkeeping for the latency histograms.
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens_seen: int = 0

    def __post_init__(self) -> None:
        self.collector = RequestOutputCollector(self.output_kind)


_ACCEPTED = object()


class AsyncLLM:
    """Serve many concurrent asyncio callers from one `LLMEngine` on its own thread."""

    def __init__(self, engine: Any, *, start: bool = True) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.metrics = EngineMetrics(
            str(self.model_config.served_model_name), lambda: self._latest_stats
        )
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        # With the core in its own process the engine thread sleeps on its pipe and this
        # socket; every command put writes a byte here to wake it.
        self._core_process = bool(getattr(engine, "engine_core_process", False))
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        if self._core_process:
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
        # Futures of ("stats",) commands the core has not answered yet, in order.
        self._stats_waiting: deque[Future] = deque()
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = (
            weakref.WeakKeyDictionary()
        )
        self._mailboxes_lock = threading.Lock()
        # Touched by the engine thread only.
        self._streams: dict[str, _RequestStream] = {}
        self._latest_stats: Any = None
        self._last_stats_time = 0.0
        self._dead: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(
            target=self._engine_loop, name="decodegraph-engine", daemon=True
        )
        if start:
            self._thread.start()

    @classmethod
    def from_engine_args(
        cls, engine_args: Any, usage_context: Any = None, *, engine_core_process: bool = False
    ) -> AsyncLLM:
        """Build the engine from `EngineArgs` (for `usage_context`, a UsageContext:
        ENGINE_CONTEXT when None), its core in a process of its own with
        `engine_core_process`, and start its thread."""
        from decodegraph.engine.arg_utils import UsageContext
        from decodegraph.engine.llm_engine import LLMEngine

        context = UsageContext.ENGINE_CONTEXT if usage_context is None else usage_context
        return cls(
            LLMEngine.from_engine_args(
                engine_args, context, engine_core_process=engine_core_process
            )
        )

    # --- asyncio side ----------------------------------------------------------------

    @property
    def errored(self) -> bool:
        """True once the engine thread has died (a step raised), a worker is gone, or
        the engine was shut down."""
        try:
            self.check_health()
        except EngineDeadError:
            return True
        return False

    def check_health(self) -> None:
        """Raise `EngineDeadError` unless the engine thread and its workers are alive."""
        if self._dead is not None:
            raise EngineDeadError(f"engine failed: {self._dead!r}")
        if not self._thread.is_alive():
            raise EngineDeadError("engine thread is not running")
        engine_health = getattr(self.engine, "check_health", None)
        if engine_health is not None:
            engine_health()

    async def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams
    ) -> _RequestStream:
        """Submit a request and wait until the engine accepted it.

        Raises ValueError (and TypeError/OverflowError) from the engine for a bad request;
        only this caller sees it. Iterate the result with `stream_outputs`.
        """
        self.check_health()
        stream = _RequestStream(request_id, self._mailbox(), params.output_kind)
        self._put(("add", stream, prompt, params))
        try:
            ack = await stream.collector.get()
        except asyncio.CancelledError:
            # The client left while we waited; the request may be in the engine already.
            self._put(("abort", [request_id]))
            raise
        if ack is not _ACCEPTED:
            raise ack
        return stream

    async def stream_outputs(self, stream: _RequestStream) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; closing early aborts it."""
        finished = False
        try:
            while True:
                item = await stream.collector.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # Runs on cancellation (client disconnect) and on aclose() as well; the abort
            # is a plain queue put so it works even while the task is being cancelled.
            if not finished:
                self._put(("abort", [stream.request_id]))

    async def generate(
        self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs (use `RequestOutputKind.DELTA` to stream).

        A bad request raises ValueError on the first iteration. If the caller stops
        iterating (disconnect, cancellation), the request is aborted and its KV blocks freed.
        """
        stream = await self.add_request(request_id, prompt, params)
        async for output in self.stream_outputs(stream):
            yield output

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests by id (unknown or finished ids are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._put(("abort", ids))

    async def get_stats(self) -> Any:
        """Exact engine stats, read on the engine thread."""
        self.check_health()
        fut: Future = Future()
        self._put(("stats", fut))
        return await asyncio.wrap_future(fut)

    def get_stats_sync(self, timeout: float = 10.0) -> Any:
        """`get_stats` for callers outside any event loop (tests, benchmarks)."""
        self.check_health()
        fut: Future = Future()
        self._put(("stats", fut))
        return fut.result(timeout)

    def _mailbox(self) -> _Mailbox:
        """The running event loop's mailbox (made on its first request)."""
        loop = asyncio.get_running_loop()
        with self._mailboxes_lock:
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = _Mailbox(loop)
        return mailbox

    def _put(self, cmd: tuple) -> None:
        """Hand a command to the engine thread (from any thread)."""
        self._commands.put(cmd)
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"\0")
            except (BlockingIOError, OSError):
                pass  # full: the thread has wake-ups pending anyway; closed: shut down

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (pending requests are aborted) and wait for it."""
        if self._thread.is_alive():
            self._put(("shutdown",))
            self._thread.join(timeout)
        engine_shutdown = getattr(self.engine, "shutdown", None)
        if engine_shutdown is not None:
            engine_shutdown()
        if self._wake_w is not None:
            self._wake_w.close()

    # --- engine thread ---------------------------------------------------------------

    def _engine_loop(self) -> None:
        engine = self.engine
        try:
            self._latest_stats = engine.get_stats()
            if self._core_process:
                self._client_loop()
            while not self._stopped:
                # Sleep on the queue only when there is nothing to step.
                busy = engine.has_unfinished_requests()
                try:
                    cmd = self._commands.get(block=not busy)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    self._handle(cmd)
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self._stopped:
                    break
                if engine.has_unfinished_requests():
                    self._route(engine.step())
                # Always refresh on going idle, or /metrics would show the last busy state.
                self._refresh_stats(force=not engine.has_unfinished_requests())
        except BaseException as e:  # noqa: BLE001 - any step failure kills the engine
            logger.exception("engine loop failed; failing every request")
            self._dead = e
            self._fail_all(EngineDeadError(f"engine failed: {e!r}"))
            self._fail_pending_commands()
            return
        self._dead = EngineDeadError("engine was shut down")
        try:
            engine.abort_request(list(self._streams))
        except Exception:  # noqa: BLE001 - best effort on shutdown
            logger.exception("abort on shutdown failed")
        self._fail_all(EngineDeadError("engine was shut down"))
        self._fail_pending_commands()

    def _client_loop(self) -> None:
        """The engine thread's loop with the core in its own process: wait for outputs
        or commands; send the commands' work to the core in one message; process and
        deliver each step's outputs as they come."""
        engine = self.engine
        client = engine.engine_core
        waitables = [client.output_conn, self._wake_r, client.process.sentinel]
        while not self._stopped:
            ready = wait(waitables)
            if self._wake_r in ready:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except BlockingIOError:
                    pass
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                self._handle(cmd)
            if self._stopped:
                return
            client.flush()
            for message in client.read_messages():
                self._route(engine.process_outputs(message.outputs))
                if message.stats is not None:
                    self._latest_stats = message.stats
                for _ in range(message.num_stats_replies):
                    self._stats_waiting.popleft().set_result(message.stats)
            client.flush()  # the stop strings' finishes
            client.check_health()

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, stream, prompt, params = cmd
            try:
                self.engine.add_request(
                    stream.request_id, prompt, params, arrival_time=stream.arrival_time
                )
            except _BAD_REQUEST_ERRORS as e:
                self._post(stream, e)
                return
            except Exception as e:  # noqa: BLE001 - an engine bug in one request's intake
                logger.exception("add_request(%s) failed", stream.request_id)
                self._post(stream, RuntimeError(f"could not add request: {e!r}"))
                return
            self._streams[stream.request_id] = stream
            self._post(stream, _ACCEPTED)
        elif kind == "abort":
            ids = [rid for rid in cmd[1] if rid in self._streams]
            if ids:
                self.engine.abort_request(ids)
                for rid in ids:
                    del self._streams[rid]
        elif kind == "stats":
            fut: Future = cmd[1]
            if self._core_process:  # answered by the core, in order
                self.engine.engine_core.request_stats()
                self._stats_waiting.append(fut)
                return
            try:
                fut.set_result(self.engine.get_stats())
            except Exception as e:  # noqa: BLE001 - hand the error to the caller
                fut.set_exception(e)
        elif kind == "shutdown":
            self._stopped = True

    def _route(self, outputs: list[RequestOutput]) -> None:
        """Deliver a step's outputs: one post per event loop, metrics on the way."""
        now = time.monotonic()
        batches: dict[_Mailbox, list[tuple[_RequestStream, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            self._observe(stream, out, now)
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.mailbox, []).append((stream, out))
        for mailbox, items in batches.items():
            mailbox.post(items)

    def _observe(self, stream: _RequestStream, out: RequestOutput, now: float) -> None:
        total = sum(len(c.token_ids) for c in out.outputs)
        if stream.output_kind == RequestOutputKind.DELTA:
            new = total
        else:  # CUMULATIVE (FINAL_ONLY shows up once: its latencies are not per token)
            new = total - stream.num_tokens_seen
            stream.num_tokens_seen = total
        metrics = self.metrics
        if new > 0:
            if stream.first_token_time is None:
                stream.first_token_time = now
                metrics.time_to_first_token.observe(now - stream.arrival_time)
            else:
                metrics.inter_token_latency.observe(now - stream.last_token_time)
            stream.last_token_time = now
        if out.finished:
            metrics.e2e_request_latency.observe(now - stream.arrival_time)

    def _refresh_stats(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._last_stats_time >= _STATS_INTERVAL_S:
            self._latest_stats = self.engine.get_stats()
            self._last_stats_time = now

    @staticmethod
    def _post(stream: _RequestStream, item: Any) -> None:
        stream.mailbox.post([(stream, item)])

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            self._post(stream, error)
        self._streams.clear()

    def _fail_pending_commands(self) -> None:
        error = EngineDeadError("engine is not running")
        while self._stats_waiting:
            self._stats_waiting.popleft().set_exception(error)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._post(cmd[1], error)
            elif cmd[0] == "stats":
                cmd[1].set_exception(error)
