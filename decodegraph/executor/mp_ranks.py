"""The spawned ranks of the "mp" executor: their cores and threads, how they start,
connect to the driver and answer its calls (multiproc.py is the driver's side)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from multiprocessing.process import BaseProcess

from decodegraph.gc_utils import collector_paused, frozen_heap

with collector_paused():  # torch, first thing in a spawned rank (gc_utils)
    from decodegraph.config import EngineConfig
    from decodegraph.executor.abstract import resolve_worker_cls

logger = logging.getLogger(__name__)

# The method name that ends a worker's loop (after its worker's own `shutdown`).
SHUTDOWN = "__shutdown__"
# The last call of a rank's start-up (EngineCore's lockstep: load ... capture).
STARTUP_ENDS_WITH = "capture_graphs"
# How long other nodes' ranks have to connect to the driver, and to keep retrying when
# they start before it.
NODE_CONNECT_TIMEOUT_S = float(os.environ.get("DECODEGRAPH_NODE_CONNECT_TIMEOUT_S", "600"))


def rpc_authkey(config: EngineConfig) -> bytes:
    """The RPC listener's key: DECODEGRAPH_RPC_AUTHKEY, else one derived from the
    rendezvous address (which keeps strangers' stray connections out, not an attacker:
    set a secret on every node when the port is reachable from other hosts)."""
    secret = os.environ.get("DECODEGRAPH_RPC_AUTHKEY")
    if secret:
        return secret.encode()
    pc = config.parallel_config
    return hashlib.sha256(f"decodegraph:{pc.master_addr}:{pc.master_port}".encode()).digest()


def cpu_shares(local_world_size: int) -> list[list[int]]:
    """Each local rank's cores: the process's allowed cores in equal contiguous shares
    (a rank gets one core, shared round-robin, when there are fewer cores than ranks)."""
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:
        cores = list(range(os.cpu_count() or 1))
    if len(cores) < local_world_size:
        return [[cores[r % len(cores)]] for r in range(local_world_size)]
    per = len(cores) // local_world_size
    return [cores[r * per : (r + 1) * per] for r in range(local_world_size)]


def rank_env(local_world_size: int) -> dict[str, str]:
    """The environment spawned ranks add to the parent's: their intra-op threads, the
    parent's cores split between the node's ranks (unless the user set it)."""
    if os.environ.get("DECODEGRAPH_CPU_THREADS"):
        return {}
    cores = len(cpu_shares(1)[0])
    return {"DECODEGRAPH_CPU_THREADS": str(max(1, cores // local_world_size))}


@dataclass
class _RankArgs:
    """What a spawned rank needs to start (pickled into the new process)."""

    config: EngineConfig
    rank: int
    local_rank: int
    distributed_init_method: str
    env: dict[str, str]
    cpus: list[int]
    parent_pid: int
    # PR_SET_PDEATHSIG fires when the thread that spawned the process ends: only a
    # process spawned from the main thread uses it (the pid watch covers the others).
    use_pdeathsig: bool
    log_level: int
    # This node's pipe end, or (host, port, authkey) of the driver's RPC listener.
    driver: Connection | tuple[str, int, bytes]


# ----------------------------------------------------------------------------- worker


def die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """End this spawned process when its parent ends: PR_SET_PDEATHSIG (Linux; only when
    the parent spawned it from its main thread) and a thread that watches the pid."""
    if use_pdeathsig and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    # The parent may have gone before prctl took effect.
    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _connect_driver(host: str, port: int, authkey: bytes) -> Connection:
    deadline = time.monotonic() + NODE_CONNECT_TIMEOUT_S
    while True:
        try:
            return Client((host, port), authkey=authkey)
        except (TimeoutError, ConnectionRefusedError, ConnectionResetError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _error_reply(tb: str, exc: BaseException) -> tuple:
    try:
        pickle.dumps(exc)
    except Exception:
        exc = None  # the traceback text still says what happened
    return ("error", tb, exc)


def _worker_main(a: _RankArgs) -> None:
    """A spawned rank: build the worker, then answer the driver's calls until told to
    stop or the driver goes away."""
    die_with_parent(a.parent_pid, a.use_pdeathsig)
    # Ctrl-C reaches the whole process group: the driver decides what stops, not this.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(a.env)
    logging.basicConfig(
        level=a.log_level, format=f"%(levelname)s rank {a.rank} %(name)s: %(message)s"
    )
    if a.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, a.cpus)
    logger.info(
        "rank %d (local rank %d, pid %d): CPUs %s, DECODEGRAPH_CPU_THREADS=%s",
        a.rank,
        a.local_rank,
        os.getpid(),
        a.cpus or "all",
        os.environ.get("DECODEGRAPH_CPU_THREADS", "unset"),
    )
    if isinstance(a.driver, tuple):
        host, port, authkey = a.driver
        conn = _connect_driver(host, port, authkey)
        conn.send(("hello", a.rank, os.getpid(), socket.gethostname()))
    else:
        conn = a.driver
    try:
        with collector_paused():  # the worker's modules import here (gc_utils)
            worker_cls = resolve_worker_cls(a.config.parallel_config.worker_cls)
            worker = worker_cls(
                a.config,
                rank=a.rank,
                local_rank=a.local_rank,
                distributed_init_method=a.distributed_init_method,
            )
        worker.init_device()
    except Exception as e:
        conn.send(_error_reply(traceback.format_exc(), e))
        conn.close()
        sys.exit(1)
    conn.send(("ok", os.getpid()))
    # The rank's start-up, up to its capture, leaves the heap it has now out of its
    # collections (gc_utils; the driver's engine core does the same for its process).
    startup = contextlib.ExitStack()
    startup.enter_context(frozen_heap())
    while True:
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            sys.exit(1)  # the driver is gone
        if method == SHUTDOWN:
            if hasattr(worker, "shutdown"):
                worker.shutdown()
            conn.close()
            return
        try:
            reply: tuple = ("ok", getattr(worker, method)(*args, **kwargs))
        except Exception as e:
            reply = _error_reply(traceback.format_exc(), e)
        if method == STARTUP_ENDS_WITH:
            startup.close()  # once: a closed stack has nothing left to exit
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            conn.send(_error_reply(traceback.format_exc(), e))
        except (EOFError, OSError):
            sys.exit(1)


def spawn_ranks(
    config: EngineConfig, init_method: str, driver_address: tuple[str, int, bytes] | None
) -> tuple[list[BaseProcess], list[Connection]]:
    """Start this node's ranks; on node 0 with the driver's ends of their pipes."""
    pc = config.parallel_config
    ctx = multiprocessing.get_context("spawn")
    local_world = pc.local_world_size
    env = rank_env(local_world)
    shares = cpu_shares(local_world)
    use_pdeathsig = threading.current_thread() is threading.main_thread()
    processes, conns = [], []
    for local_rank in range(local_world):
        rank = pc.node_rank * local_world + local_rank
        if driver_address is None:
            conn, child_end = ctx.Pipe(duplex=True)
            conns.append(conn)
        else:
            child_end = driver_address
        args = _RankArgs(
            config=config,
            rank=rank,
            local_rank=local_rank,
            distributed_init_method=init_method,
            env=env,
            cpus=shares[local_rank],
            parent_pid=os.getpid(),
            use_pdeathsig=use_pdeathsig,
            log_level=logging.getLogger().getEffectiveLevel(),
            driver=child_end,
        )
        p = ctx.Process(target=_worker_main, args=(args,), name=f"decodegraph-rank{rank}")
        p.start()
        processes.append(p)
        if driver_address is None:
            child_end.close()
    logger.info(
        "node %d: ranks %s as processes %s, CPUs %s (os.sched_setaffinity), "
        "DECODEGRAPH_CPU_THREADS=%s",
        pc.node_rank,
        [pc.node_rank * local_world + r for r in range(local_world)],
        [p.pid for p in processes],
        shares if hasattr(os, "sched_setaffinity") else "not pinned",
        env.get("DECODEGRAPH_CPU_THREADS", os.environ.get("DECODEGRAPH_CPU_THREADS")),
    )
    return processes, conns


def stop_processes(processes: list[BaseProcess], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
