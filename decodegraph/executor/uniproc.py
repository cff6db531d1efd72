"""The "uni" executor: the one worker (rank 0 of 1) lives in the driver's process."""

from __future__ import annotations

from typing import Any

from decodegraph.config import EngineConfig
from decodegraph.executor.abstract import (
    Executor,
    free_port,
    resolve_worker_cls,
    tcp_init_method,
)


class UniProcExecutor(Executor):
    """Rank 0 of a world of 1, in process: a step is a plain call into the worker."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        pc = config.parallel_config
        worker_cls = resolve_worker_cls(pc.worker_cls)
        host = pc.master_addr
        init_method = tcp_init_method(host, pc.master_port or free_port(host))
        self.driver_worker = worker_cls(
            config, rank=0, local_rank=0, distributed_init_method=init_method
        )
        self.driver_worker.init_device()
        # The step path is the worker's own bound method: no frame, no message, and its
        # exceptions arrive as they were raised.
        self.execute_model = self.driver_worker.execute_model

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout_s: float | None = None,
    ) -> list:
        # Exceptions arrive as they were raised (a bad checkpoint's ValueError stays one).
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, *args: Any) -> Any:  # replaced per instance in __init__
        return self.driver_worker.execute_model(*args)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        worker = self.__dict__.pop("driver_worker", None)
        self.__dict__.pop("execute_model", None)
        if worker is not None and hasattr(worker, "shutdown"):
            worker.shutdown()
