"""The "mp" executor: one spawned process per rank, on one node or several.

Node 0 runs the driver (the engine) and its local ranks; each other node runs
`run_headless` (`decodegraph serve --headless`), which spawns that node's local ranks.
Rank r on node n is `n * local_world_size + local_rank`. Two ports on node 0:

- master_port: torch.distributed's rendezvous, tcp://master_addr:master_port (a free
  port when one node and no master_port is given);
- master_port + 1: the driver's RPC listener, which other nodes' ranks connect to
  (multiprocessing.connection with an authkey: DECODEGRAPH_RPC_AUTHKEY, the same on every
  node).

The driver talks to its local ranks over pipes. A call pickles its message once and
sends it to each rank; each rank answers once. Waiting for the answers also waits on the
local processes' sentinels, so a killed worker is a `WorkerDiedError` at once, and a
rank that does not answer within the call's time-out is one too. Workers die with their
parent (PR_SET_PDEATHSIG on Linux, and a thread that watches the parent's pid) and with
the driver's connection: a worker whose connection closes exits (mp_ranks.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait
from multiprocessing.process import BaseProcess
from typing import Any

from decodegraph.config import EngineConfig
from decodegraph.executor.abstract import (
    DEFAULT_RPC_TIMEOUT_S,
    Executor,
    WorkerDiedError,
    WorkerError,
    free_port,
    tcp_init_method,
)
from decodegraph.executor.mp_ranks import (
    NODE_CONNECT_TIMEOUT_S,
    SHUTDOWN,
    rpc_authkey,
    spawn_ranks,
    stop_processes,
)

logger = logging.getLogger(__name__)

# A healthy worker's time to leave after the shutdown message before it is terminated.
_SHUTDOWN_GRACE_S = 5.0
# Once a rank has raised, how long the others have to answer: one still waiting in a
# collective for the rank that raised never will.
AFTER_ERROR_S = 10.0


# ----------------------------------------------------------------------------- driver


@dataclass
class _Rank:
    rank: int
    conn: Connection
    process: BaseProcess | None  # None: on another node
    pid: int | None = None
    host: str = ""


@dataclass
class _State:
    """What shutdown needs: kept apart from the executor so a finalizer can hold it."""

    ranks: list[_Rank] = field(default_factory=list)
    processes: list[BaseProcess] = field(default_factory=list)
    listener: Listener | None = None
    stopped: bool = False
    healthy: bool = True


def _shutdown_state(state: _State) -> None:
    if state.stopped:
        return
    state.stopped = True
    if state.listener is not None:
        state.listener.close()
    if state.healthy:
        message = pickle.dumps((SHUTDOWN, (), {}))
        for r in state.ranks:
            try:
                r.conn.send_bytes(message)
            except (OSError, ValueError):
                pass
    stop_processes(state.processes, _SHUTDOWN_GRACE_S if state.healthy else 0.0)
    for r in state.ranks:
        r.conn.close()


class MultiprocExecutor(Executor):
    """Every rank a spawned process; other nodes' ranks connect over TCP."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        pc = config.parallel_config
        if pc.node_rank != 0:
            raise ValueError(
                f"node_rank: {pc.node_rank} runs no driver; start that node with "
                "`decodegraph serve --headless` (run_headless)"
            )
        self._lock = threading.Lock()
        self._failed: WorkerDiedError | None = None
        self._state = _State()
        self._finalizer = weakref.finalize(self, _shutdown_state, self._state)
        # Registered now, after multiprocessing's own exit hook, so it runs before that
        # hook joins (and would wait forever on) live workers.
        atexit.register(self._finalizer)
        try:
            self._start()
        except BaseException:
            self._state.healthy = False  # ranks stuck at the rendezvous read no message
            self.shutdown()
            raise

    def _start(self) -> None:
        pc = self.parallel_config
        host = pc.master_addr
        init_method = tcp_init_method(host, pc.master_port or free_port(host))
        accepted: queue.Queue = queue.Queue()
        if pc.nnodes > 1:
            self._state.listener = Listener(
                (host, pc.master_port + 1), authkey=rpc_authkey(self.config)
            )
            threading.Thread(
                target=_accept_ranks,
                args=(self._state.listener, accepted),
                name="rpc-accept",
                daemon=True,
            ).start()
        processes, conns = spawn_ranks(self.config, init_method, None)
        self._state.processes = processes
        ranks = [_Rank(r, c, p) for r, (c, p) in enumerate(zip(conns, processes, strict=True))]
        self._state.ranks = ranks
        if pc.nnodes > 1:
            self._accept_remote(accepted, ranks)
            self._state.listener.close()
            self._state.listener = None
        ranks.sort(key=lambda r: r.rank)
        self._ranks = ranks
        try:
            pids = self._gather("init_device", time.monotonic() + DEFAULT_RPC_TIMEOUT_S)
        except WorkerDiedError as e:
            # The others were waiting for it at the rendezvous: its error is the news.
            if isinstance(e.__cause__, WorkerError):
                raise e.__cause__ from None
            raise
        for r, pid in zip(ranks, pids, strict=True):
            r.pid = pid
        logger.info(
            "mp executor: %d ranks on %d node(s), rendezvous %s, pids %s",
            self.world_size,
            pc.nnodes,
            init_method,
            pids,
        )

    def _accept_remote(self, accepted: queue.Queue, ranks: list[_Rank]) -> None:
        """Add other nodes' ranks to `ranks` as they connect."""
        pc = self.parallel_config
        local = list(ranks)
        expected = set(range(pc.local_world_size, self.world_size))
        deadline = time.monotonic() + NODE_CONNECT_TIMEOUT_S
        while expected:
            for r in local:
                if not r.process.is_alive():
                    raise WorkerDiedError(
                        r.rank, f"(pid {r.process.pid}) died: exit code {r.process.exitcode}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(expected)} did not connect to {pc.master_addr}:"
                    f"{pc.master_port + 1} within {NODE_CONNECT_TIMEOUT_S:.0f} s "
                    "(DECODEGRAPH_NODE_CONNECT_TIMEOUT_S)"
                )
            try:
                conn, hello = accepted.get(timeout=0.5)
            except queue.Empty:
                continue
            match hello:
                case ("hello", int(rank), int(pid), str(hostname)) if rank in expected:
                    expected.discard(rank)
                    ranks.append(_Rank(rank, conn, None, pid, hostname))
                    logger.info("rank %d (pid %d on %s) connected", rank, pid, hostname)
                case _:
                    logger.warning("rejected an RPC connection that said %.100r", hello)
                    conn.close()

    # ------------------------------------------------------------------------- calls

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout_s: float | None = None,
    ) -> list:
        message = pickle.dumps((method, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        deadline = time.monotonic() + (DEFAULT_RPC_TIMEOUT_S if timeout_s is None else timeout_s)
        with self._lock:
            self._check_usable()
            for r in self._ranks:
                try:
                    r.conn.send_bytes(message)
                except OSError:
                    pass  # a dead rank: _gather names it
            return self._gather(method, deadline)

    def _gather(self, method: str, deadline: float) -> list:
        """Every rank's answer, in rank order; raises as the module docstring says."""
        results: list[Any] = [None] * len(self._ranks)
        errors: list[WorkerError] = []
        errors_at = 0.0
        pending = {r.conn: r for r in self._ranks}
        sentinels = {r.process.sentinel: r for r in self._ranks if r.process is not None}
        while pending:
            if errors:
                deadline = min(deadline, errors_at + AFTER_ERROR_S)
            remaining = deadline - time.monotonic()
            watched = [s for s, r in sentinels.items() if r.conn in pending]
            ready = wait([*pending, *watched], timeout=max(0.0, remaining)) if remaining > 0 else []
            if not ready:
                r = min(pending.values(), key=lambda r: r.rank)
                after = f" after {str(errors[0]).splitlines()[0]}" if errors else ""
                err = WorkerDiedError(
                    r.rank,
                    f"({self._where(r)}) did not answer {method!r} in time{after}; "
                    "the executor stops",
                )
                self._fail(err)
                raise err from (errors[0] if errors else None)
            for obj in ready:
                r = pending.get(obj)
                if r is None:
                    continue
                try:
                    reply = obj.recv()
                except (EOFError, OSError):
                    self._fail(self._died(r))
                    raise self._failed from (errors[0] if errors else None)
                del pending[obj]
                if reply[0] == "ok":
                    results[r.rank] = reply[1]
                else:
                    err = WorkerError(r.rank, method, reply[1])
                    err.__cause__ = reply[2]
                    if not errors:
                        errors_at = time.monotonic()
                    errors.append(err)
            for obj in ready:
                r = sentinels.get(obj)
                # A reply sent just before the process ended is still to be read.
                if r is not None and r.conn in pending and not r.conn.poll():
                    self._fail(self._died(r))
                    raise self._failed from (errors[0] if errors else None)
        if errors:
            raise min(errors, key=lambda e: e.rank)
        return results

    def _where(self, r: _Rank) -> str:
        pid = r.pid if r.pid is not None else (r.process.pid if r.process else "?")
        return f"pid {pid}" + (f" on {r.host}" if r.process is None else "")

    def _died(self, r: _Rank) -> WorkerDiedError:
        if r.process is None:
            return WorkerDiedError(r.rank, f"({self._where(r)}) disconnected")
        r.process.join(1.0)
        return WorkerDiedError(r.rank, f"({self._where(r)}) died: exit code {r.process.exitcode}")

    def _fail(self, err: WorkerDiedError) -> None:
        if self._failed is None:
            self._failed = err
            self._state.healthy = False
            logger.error("%s", err)

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._state.stopped:
            raise RuntimeError("the executor is shut down")

    def check_health(self) -> None:
        self._check_usable()
        for r in self._ranks:
            if r.process is not None and not r.process.is_alive():
                self._fail(self._died(r))
                raise self._failed
        # Other nodes' ranks: a closed connection reads as ready; only looked at while no
        # call is in flight (that call would see it first).
        if self._lock.acquire(blocking=False):
            try:
                for r in self._ranks:
                    if r.process is None and r.conn.poll():
                        self._fail(self._died(r))
                        raise self._failed
            finally:
                self._lock.release()

    def shutdown(self) -> None:
        self._finalizer()
        atexit.unregister(self._finalizer)


def _accept_ranks(listener: Listener, accepted: queue.Queue) -> None:
    """Accept other nodes' ranks until the listener closes (a bad key is skipped)."""
    while True:
        try:
            conn = listener.accept()
        except OSError:
            return  # closed
        except Exception as e:  # AuthenticationError, a client gone mid-handshake
            logger.warning("refused an RPC connection: %s", e)
            continue
        try:
            if conn.poll(30.0):
                accepted.put((conn, conn.recv()))
                continue
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        conn.close()


# ----------------------------------------------------------------------------- headless


def run_headless(config: EngineConfig) -> int:
    """Run node `node_rank`'s ranks (node_rank > 0) until the driver on node 0 shuts them
    down; 0 when every rank stopped cleanly."""
    pc = config.parallel_config
    if pc.node_rank == 0:
        raise ValueError("node_rank: 0 runs the driver; --headless is for node_rank > 0")
    if pc.distributed_executor_backend != "mp":
        raise ValueError(
            "distributed_executor_backend: --headless nodes run the 'mp' backend, got "
            f"{pc.distributed_executor_backend!r}"
        )
    if not os.environ.get("DECODEGRAPH_RPC_AUTHKEY"):
        logger.warning(
            "DECODEGRAPH_RPC_AUTHKEY is not set: the RPC key is derived from the address; "
            "set the same secret on every node"
        )
    init_method = tcp_init_method(pc.master_addr, pc.master_port)
    address = (pc.master_addr, pc.master_port + 1, rpc_authkey(config))
    processes, _ = spawn_ranks(config, init_method, address)
    logger.info(
        "node %d of %d: connecting to the driver at %s:%d (rendezvous %s)",
        pc.node_rank,
        pc.nnodes,
        pc.master_addr,
        pc.master_port + 1,
        init_method,
    )
    if threading.current_thread() is threading.main_thread():
        # SIGTERM stops the ranks too (they would die with this process anyway).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        # Once one rank has ended (the driver stopped them, or it crashed), the others
        # have a moment to follow before they are stopped: none outlives this call.
        wait([p.sentinel for p in processes])
        stop_processes(processes, _SHUTDOWN_GRACE_S)
    finally:
        stop_processes(processes, 0.0)
    codes = [p.exitcode for p in processes]
    logger.info("node %d: ranks exited with %s", pc.node_rank, codes)
    return 0 if all(c == 0 for c in codes) else 1
