"""The "ray" executor: the same workers as Ray actors, one per rank, on any Ray cluster.

`ray.init()` is called only when Ray is not initialised yet (it then joins RAY_ADDRESS's
cluster, or starts a local one, and is shut down with the executor). Each actor asks for
one GPU on CUDA, one CPU otherwise. Ranks follow the actors' order; a rank's local rank is
its index among the actors on its node, and on CUDA every actor of a node sees all of
that node's actors' GPUs (so NCCL can use peer-to-peer copies). torch.distributed meets at
rank 0's node IP on a port that is free there.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections import defaultdict
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from decodegraph.config import EngineConfig
from decodegraph.executor.abstract import (
    DEFAULT_RPC_TIMEOUT_S,
    Executor,
    WorkerDiedError,
    WorkerError,
    free_port,
    resolve_worker_cls,
    tcp_init_method,
)
from decodegraph.executor.multiproc import AFTER_ERROR_S

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 10.0


@ray.remote(concurrency_groups={"health": 1})
class RayWorkerWrapper:
    """Holds one rank's worker inside a Ray actor and calls into it."""

    def __init__(self) -> None:
        self.worker: Any = None

    def placement(self) -> tuple[str, str, list[str], int]:
        """(node id, node IP, this actor's GPU ids, cores on the node)."""
        ctx = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        return ctx.get_node_id(), ray.util.get_node_ip_address(), gpu_ids, os.cpu_count() or 1

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(
        self,
        config: EngineConfig,
        rank: int,
        local_rank: int,
        distributed_init_method: str,
        env: dict[str, str],
    ) -> tuple:
        os.environ.update(env)
        try:
            worker_cls = resolve_worker_cls(config.parallel_config.worker_cls)
            self.worker = worker_cls(
                config,
                rank=rank,
                local_rank=local_rank,
                distributed_init_method=distributed_init_method,
            )
            self.worker.init_device()
        except Exception:
            return ("error", traceback.format_exc())
        return ("ok", os.getpid())

    def call(self, method: str, args: tuple, kwargs: dict) -> tuple:
        try:
            return ("ok", getattr(self.worker, method)(*args, **kwargs))
        except Exception:
            return ("error", traceback.format_exc())

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        return os.getpid()


def _driver_pythonpath() -> str:
    """The driver's own import directories (not the interpreter's), so that actors import
    the same decodegraph and worker class as the driver."""
    prefixes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    paths = [os.path.abspath(p) for p in sys.path if p and not p.startswith(prefixes)]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(p for p in paths if os.path.isdir(p)))


class RayExecutor(Executor):
    """Every rank a Ray actor."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._lock = threading.Lock()
        self._failed: WorkerDiedError | None = None
        self._stopped = False
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init()
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        on_cuda = self.config.device_config.device == "cuda"
        resources = {"num_gpus": 1, "num_cpus": 0} if on_cuda else {"num_cpus": 1}
        runtime_env = {"env_vars": {"PYTHONPATH": _driver_pythonpath()}}
        self.actors = [
            RayWorkerWrapper.options(
                runtime_env=runtime_env, name=None, max_restarts=0, **resources
            ).remote()
            for _ in range(self.world_size)
        ]
        places = self._get([a.placement.remote() for a in self.actors], "placement")
        by_node: dict[str, list[int]] = defaultdict(list)
        for rank, (node, *_) in enumerate(places):
            by_node[node].append(rank)
        ip = places[0][1]
        port = self._get([self.actors[0].free_port.remote(ip)], "free_port")[0]
        init_method = tcp_init_method(ip, port)
        starts = []
        for rank, (node, _, gpus, cores) in enumerate(places):
            peers = by_node[node]
            env = {}
            if not os.environ.get("DECODEGRAPH_CPU_THREADS"):
                env["DECODEGRAPH_CPU_THREADS"] = str(max(1, cores // len(peers)))
            local_rank = peers.index(rank)
            if on_cuda:
                node_gpus = sorted({g for r in peers for g in places[r][2]}, key=int)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
                local_rank = node_gpus.index(gpus[0])
            starts.append(
                self.actors[rank].start.remote(self.config, rank, local_rank, init_method, env)
            )
        self.pids = self._gather(starts, "init_device", time.monotonic() + DEFAULT_RPC_TIMEOUT_S)
        logger.info(
            "ray executor: %d ranks as actors on %d node(s), rendezvous %s, pids %s",
            self.world_size,
            len(by_node),
            init_method,
            self.pids,
        )

    def _get(self, refs: list, what: str) -> list:
        try:
            return ray.get(refs, timeout=DEFAULT_RPC_TIMEOUT_S)
        except RayActorError as e:
            raise WorkerDiedError(-1, f"died while answering {what!r}: {e}") from e

    # ------------------------------------------------------------------------- calls

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout_s: float | None = None,
    ) -> list:
        deadline = time.monotonic() + (DEFAULT_RPC_TIMEOUT_S if timeout_s is None else timeout_s)
        with self._lock:
            self._check_usable()
            refs = [a.call.remote(method, args, kwargs or {}) for a in self.actors]
            return self._gather(refs, method, deadline)

    def _gather(self, refs: list, method: str, deadline: float) -> list:
        """Every rank's answer in rank order; faults as in the abstract module."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        errors: list[WorkerError] = []
        errors_at = 0.0
        pending = list(refs)
        while pending:
            if errors:
                deadline = min(deadline, errors_at + AFTER_ERROR_S)
            remaining = deadline - time.monotonic()
            ready, pending = (
                ray.wait(pending, num_returns=1, timeout=remaining) if remaining > 0 else ([], [])
            )
            if not ready:
                rank = min(rank_of[r] for r in (pending or refs))
                after = f" after {str(errors[0]).splitlines()[0]}" if errors else ""
                err = WorkerDiedError(
                    rank, f"did not answer {method!r} in time{after}; the executor stops"
                )
                self._fail(err)
                raise err from (errors[0] if errors else None)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    status, value = ray.get(ref)
                except RayActorError as e:
                    self._fail(self._died(rank, e))
                    raise self._failed from e
                if status == "ok":
                    results[rank] = value
                else:
                    if not errors:
                        errors_at = time.monotonic()
                    errors.append(WorkerError(rank, method, value))
        if errors:
            raise min(errors, key=lambda e: e.rank)
        return results

    def _died(self, rank: int, e: RayActorError) -> WorkerDiedError:
        pids = getattr(self, "pids", None)
        where = f"pid {pids[rank]}, Ray actor" if pids else "Ray actor"
        return WorkerDiedError(rank, f"({where}) died: {_first_line(e)}")

    def _fail(self, err: WorkerDiedError) -> None:
        if self._failed is None:
            self._failed = err
            logger.error("%s", err)

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._stopped:
            raise RuntimeError("the executor is shut down")

    def check_health(self) -> None:
        self._check_usable()
        refs = [a.ping.remote() for a in self.actors]
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=HEALTH_CHECK_TIMEOUT_S)
            except RayActorError as e:
                self._fail(self._died(rank, e))
                raise self._failed from e
            except GetTimeoutError as e:
                raise WorkerDiedError(rank, "did not answer a health check") from e

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        actors = getattr(self, "actors", [])
        if self._failed is None and actors:
            try:
                ray.get([a.call.remote("shutdown", (), {}) for a in actors], timeout=5.0)
            except Exception:
                pass  # they are killed below either way
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
