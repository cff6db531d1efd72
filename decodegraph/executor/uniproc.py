"""TEMPORARY (lead's stand-in until the process side lands)."""

from __future__ import annotations

import importlib
from typing import Any

from decodegraph.executor.abstract import Executor


class UniProcExecutor(Executor):
    def __init__(self, config: Any) -> None:
        mod, _, name = getattr(
            config.parallel_config, "worker_cls", "decodegraph.worker.worker.Worker"
        ).rpartition(".")
        cls = getattr(importlib.import_module(mod), name)
        self.driver_worker = cls(config, rank=0, local_rank=0, distributed_init_method=None)
        self.driver_worker.init_device()

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout_s: float | None = None,
    ) -> list:
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, *args: Any) -> Any:
        return self.driver_worker.execute_model(*args)

    def shutdown(self) -> None:
        pass
