"""TEMPORARY (lead's stand-in until the process side lands)."""

from __future__ import annotations

from typing import Any


class WorkerError(RuntimeError):
    pass


class WorkerDiedError(WorkerError):
    pass


class Executor:
    @staticmethod
    def get_class(config: Any) -> type[Executor]:
        from decodegraph.executor.uniproc import UniProcExecutor

        return UniProcExecutor

    def check_health(self) -> None:
        pass
