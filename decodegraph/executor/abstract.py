"""The executor contract: one worker per rank, driven from the engine's process.

Every executor constructs `worker_cls(config, rank=r, local_rank=l,
distributed_init_method="tcp://addr:port")` for each rank, then calls its `init_device()`;
everything else is `collective_rpc(method, args)`, which calls the method on every rank
and returns their results in rank order. The backends differ only in where workers live:
"uni" in the driver, "mp" in spawned processes (on one or several nodes), "ray" in Ray
actors.

Faults. A method that raises on a worker is a `WorkerError` (the rank, the method and the
remote traceback) once every rank has answered; the executor stays usable, but after a
collective method (one that all-reduces) the ranks may disagree on their state, so the
engine treats an error in a step as fatal. A worker that dies, disconnects or does not
answer within the call's time-out is a `WorkerDiedError`: the executor is then failed
(every later call and `check_health` raise the same error) and only `shutdown` remains.
"""

from __future__ import annotations

import importlib
import os
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from decodegraph.config import EngineConfig


class WorkerError(RuntimeError):
    """A worker's method raised: which rank, which method, and the remote traceback.

    `__cause__` is the worker's exception itself where it could be carried back."""

    def __init__(self, rank: int, method: str, remote_traceback: str) -> None:
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else "?"
        super().__init__(
            f"worker rank {rank} raised in {method!r}: {last}\n"
            f"--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}"
        )


class WorkerDiedError(WorkerError):
    """A worker is gone (killed, crashed, disconnected) or stopped answering: the
    executor cannot run another step."""

    def __init__(self, rank: int, reason: str) -> None:
        self.rank = rank
        self.method = ""
        self.remote_traceback = ""
        self.reason = reason
        RuntimeError.__init__(self, f"worker rank {rank} {reason}")


class Executor:
    """Runs one worker per rank; the engine talks to all of them through this."""

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor class of `parallel_config.distributed_executor_backend`."""
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from decodegraph.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from decodegraph.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from decodegraph.executor.ray_executor import RayExecutor

            return RayExecutor
        raise ValueError(f"distributed_executor_backend: {backend!r} is not one of uni, mp, ray")

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.parallel_config = config.parallel_config
        self.world_size = config.parallel_config.world_size

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout_s: float | None = None,
    ) -> list:
        """Call `method(*args, **kwargs)` on every rank; their results in rank order.

        `timeout_s` None: `DEFAULT_RPC_TIMEOUT_S`."""
        raise NotImplementedError

    def execute_model(self, *args: Any) -> Any:
        """One step on every rank; rank 0's result, once every rank has answered."""
        return self.collective_rpc("execute_model", args, timeout_s=EXECUTE_MODEL_TIMEOUT_S)[0]

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if any worker is gone."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop every worker; idempotent, and no worker process outlives it."""
        raise NotImplementedError


# A call that is not a step (loading, profiling, capturing graphs) may take minutes.
DEFAULT_RPC_TIMEOUT_S = float(os.environ.get("DECODEGRAPH_RPC_TIMEOUT_S", "1800"))
# A step that takes longer than this means a rank is stuck (most likely in a collective
# whose peer is gone): the executor fails instead of hanging the engine.
EXECUTE_MODEL_TIMEOUT_S = float(os.environ.get("DECODEGRAPH_EXECUTE_MODEL_TIMEOUT_S", "60"))


def resolve_worker_cls(qualname: str) -> type:
    """Import `module.Class` (ParallelConfig.worker_cls)."""
    module_name, _, cls_name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_cls: cannot import {qualname!r}: {e}") from e


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on at `host` now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_init_method(host: str, port: int) -> str:
    """torch.distributed's init method for a rendezvous at host:port."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
