"""A model-free worker for executor tests: gloo process group, an all-reduce, and ways
to fail (raise, hang, exit). Imported by its qualified name in spawned processes and Ray
actors, as `ParallelConfig.worker_cls` says."""

from __future__ import annotations

import gc
import os
import time

import torch
import torch.distributed as dist

from decodegraph.config import EngineConfig, ModelConfig, ParallelConfig

QUALNAME = "tests.executor.dummy_worker.DummyWorker"


def dummy_config(**parallel: object) -> EngineConfig:
    """An engine config that runs `DummyWorker` (the model is never read)."""
    return EngineConfig(
        model_config=ModelConfig(model="dummy"),
        parallel_config=ParallelConfig(worker_cls=QUALNAME, **parallel),
    )


class DummyWorker:
    """Follows the worker contract: constructed with its rank, then `init_device()`."""

    def __init__(
        self, config: EngineConfig, rank: int, local_rank: int, distributed_init_method: str
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.init_method = distributed_init_method
        if os.environ.get("DUMMY_WORKER_FAIL_INIT_RANK") == str(rank):
            raise RuntimeError(f"init failed on rank {rank} (asked to)")

    def init_device(self) -> None:
        dist.init_process_group(
            "gloo",
            init_method=self.init_method,
            world_size=self.config.parallel_config.world_size,
            rank=self.rank,
        )

    def echo(self, value: object) -> tuple[int, object]:
        return self.rank, value

    def all_reduce(self, value: float) -> float:
        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        return t.item()

    def execute_model(self, value: float) -> float:
        """A collective step: every rank adds its rank to `value`, summed over ranks."""
        return self.all_reduce(value + self.rank)

    def raise_error(self, on_rank: int | None = None) -> int:
        if on_rank is None or on_rank == self.rank:
            raise ValueError(f"asked to fail on rank {self.rank}")
        return self.rank

    def raise_then_all_reduce(self, on_rank: int) -> float:
        """Rank `on_rank` raises; the others wait for it in an all-reduce."""
        if self.rank == on_rank:
            raise ValueError(f"asked to fail on rank {self.rank}")
        return self.all_reduce(1.0)

    def sleep(self, seconds: float, on_rank: int | None = None) -> int:
        if on_rank is None or on_rank == self.rank:
            time.sleep(seconds)
        return self.rank

    def exit(self, code: int, on_rank: int | None = None) -> int:
        if on_rank is None or on_rank == self.rank:
            os._exit(code)
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def process_info(self) -> dict[str, object]:
        import decodegraph

        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "rank": self.rank,
            "local_rank": self.local_rank,
            "affinity": affinity,
            "cpu_threads": os.environ.get("DECODEGRAPH_CPU_THREADS"),
            "decodegraph": decodegraph.__file__,
        }

    def unpicklable(self) -> object:
        return lambda: None

    def gc_state(self) -> tuple[bool, int]:
        """Whether the collector runs, and how many objects it leaves out (frozen)."""
        return gc.isenabled(), gc.get_freeze_count()

    def capture_graphs(self) -> None:
        """The last call of a real worker's start-up: nothing to capture here."""

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
