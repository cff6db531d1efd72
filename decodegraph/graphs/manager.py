"""Capture at start-up, replay per step: every graph of one model runner.

Capture runs largest size first into one shared memory pool (CUDA), with the garbage
collector frozen, a progress bar and one closing log line. After `close()` a capture
is a bug and raises.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from decodegraph.config import CompilationConfig
from decodegraph.graphs.dispatcher import BatchDescriptor
from decodegraph.graphs.graph import CpuGraph, CudaGraph, Graph, GraphFn
from decodegraph.graphs.modes import RuntimeMode
from decodegraph.graphs.piecewise import CudaPiece, PiecewiseGraph, cpu_piece_factory

logger = logging.getLogger(__name__)

GraphKey = tuple[RuntimeMode, BatchDescriptor]


class CaptureClosedError(RuntimeError):
    """A graph capture was attempted after start-up."""


@dataclass
class CaptureStats:
    num_graphs: int = 0  # full graphs count 1, piecewise graphs count their pieces
    seconds: float = 0.0
    memory_bytes: int = 0
    by_mode: dict[str, int] = field(default_factory=dict)


class GraphManager:
    """Holds the captured graphs, keyed by (runtime mode, batch descriptor)."""

    def __init__(
        self,
        kind: str,
        compilation_config: CompilationConfig,
        inductor_options: dict[str, object] | None = None,
    ) -> None:
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"graph kind {kind!r} is not cpu or cuda")
        self.kind = kind
        self.config = compilation_config
        # The platform's Inductor options; the user's win over them.
        self.inductor_options = {
            **(inductor_options or {}),
            **compilation_config.inductor_compile_config,
        }
        self.graphs: dict[GraphKey, Graph] = {}
        self.closed = False
        self.stats = CaptureStats()
        self._pool = torch.cuda.graph_pool_handle() if kind == "cuda" else None
        # Addresses of piece outputs: the next piece reads them in place.
        self._stable: set[int] = set()

    def capture(
        self, mode: RuntimeMode, key: BatchDescriptor, fn: GraphFn, inputs: Sequence[torch.Tensor]
    ) -> None:
        """Capture `fn(*inputs)` as the graph for (mode, key)."""
        if self.closed:
            raise CaptureClosedError(
                f"capture of {mode.name} {key} after start-up: graphs are captured only once"
            )
        name = f"{mode.name}{tuple(key)}"
        if mode is RuntimeMode.FULL:
            graph: Graph = self._full(name, fn, inputs)
            count = 1
        elif mode is RuntimeMode.PIECEWISE:
            graph = self._piecewise(name, fn, inputs)
            count = graph.num_pieces
        else:
            raise ValueError(f"no graph to capture for runtime mode {mode.name}")
        self.graphs[(mode, key)] = graph
        self.stats.num_graphs += count
        self.stats.by_mode[mode.name] = self.stats.by_mode.get(mode.name, 0) + count

    def _full(self, name: str, fn: GraphFn, inputs: Sequence[torch.Tensor]) -> Graph:
        if self.kind == "cuda":
            return CudaGraph(name, fn, inputs, self._pool, self.config.cudagraph_num_of_warmups)
        return CpuGraph(name, fn, inputs, self.config.use_inductor, self.inductor_options)

    def _piecewise(self, name: str, fn: GraphFn, inputs: Sequence[torch.Tensor]) -> PiecewiseGraph:
        if self.kind == "cuda":
            self._stable.update(t.data_ptr() for t in inputs)

            def make_piece(piece: torch.fx.GraphModule, args: tuple) -> CudaPiece:
                return CudaPiece(
                    piece, args, self._stable, self._pool, self.config.cudagraph_num_of_warmups
                )

            return PiecewiseGraph(name, fn, inputs, make_piece)
        return PiecewiseGraph(
            name, fn, inputs, cpu_piece_factory(self.config.use_inductor, self.inductor_options)
        )

    def replay(
        self, mode: RuntimeMode, key: BatchDescriptor, inputs: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        return self.graphs[(mode, key)].replay(inputs)

    def capture_all(
        self,
        keys: list[GraphKey],
        capture_one: Callable[[RuntimeMode, BatchDescriptor], None],
        memory_allocated: Callable[[], int],
    ) -> CaptureStats:
        """Capture every key (largest first), then close capture."""
        start, mem_before = time.perf_counter(), memory_allocated()
        gc.collect()
        gc.freeze()  # a collection during capture makes it slow
        try:
            for mode, key in tqdm(keys, desc="Capturing graphs", disable=not keys, leave=False):
                capture_one(mode, key)
        finally:
            gc.unfreeze()
        self.closed = True
        self.stats.seconds = time.perf_counter() - start
        self.stats.memory_bytes = max(0, memory_allocated() - mem_before)
        if keys:
            logger.info(
                "Captured %d graphs (%s) in %.1f s, %.1f MiB",
                self.stats.num_graphs,
                ", ".join(f"{m}: {n}" for m, n in self.stats.by_mode.items()),
                self.stats.seconds,
                self.stats.memory_bytes / 2**20,
            )
        return self.stats
