"""A test-only platform, and helpers to plug platforms and attention backends in.

`StaticGraphPlatform` is what a new device's module in decodegraph/platforms would be:
a `Platform` subclass and nothing else. Its graphs behave like device graphs on the CPU:
a graph is traced once, binds its inputs, and returns the *same* output tensors from
every replay (copied into at the end of the replay, as a device graph's outputs live
at fixed pool addresses). Its pieces take the base class's device path
(`Platform.make_piece`), which refuses any piece argument that is not at a stable
address: so a piecewise graph here proves that no weight is passed to, or copied into,
a piece.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils import _pytree as pytree

from decodegraph import native
from decodegraph.attention import selector
from decodegraph.attention.backends.base import AttentionBackend
from decodegraph.platforms import register_platform, unregister_platform
from decodegraph.platforms.base import DeviceGraph, GraphFn, Platform, trace
from decodegraph.platforms.cpu import CpuPlatform

if TYPE_CHECKING:
    from decodegraph.config import CompilationConfig


class StaticGraph(DeviceGraph):
    """A traced graph with static outputs: each replay writes them in place."""

    def __init__(
        self, name: str, fn: GraphFn, inputs: Sequence[torch.Tensor], decompositions: dict
    ) -> None:
        super().__init__(name, inputs)
        self.graph_module = trace(fn, self.inputs, decompositions)
        out = self.graph_module(*self.inputs)
        flat, self._spec = pytree.tree_flatten(out)
        self._static = [t.clone() for t in flat]
        self.output = pytree.tree_unflatten(self._static, self._spec)

    def _run(self) -> Any:
        flat, _ = pytree.tree_flatten(self.graph_module(*self.inputs))
        for static, fresh in zip(self._static, flat, strict=True):
            static.copy_(fresh)
        return self.output


class StaticGraphPlatform(Platform):
    """A device-like platform on the CPU (its device type is "cpu")."""

    name: ClassVar[str] = "static-graphs"
    device_type: ClassVar[str] = "cpu"
    supports_graphs: ClassVar[bool] = True
    default_attention_backend: ClassVar[str | None] = "CPU_TORCH"
    default_capture_sizes: ClassVar[list[int]] = [1, 2, 4]

    def __init__(self) -> None:
        self.graphs_made: list[StaticGraph] = []
        # (graph name, pool) per make_graph call, in order.
        self.captures: list[tuple[str, object | None]] = []
        # The weak_outputs argument of each make_graph call, in order.
        self.weak_outputs: list[bool] = []
        self._pool = object()

    def graph_pool(self) -> object:
        return self._pool

    def graph_decompositions(self) -> dict:
        return native.decompositions()

    def make_graph(
        self,
        name: str,
        fn: GraphFn,
        inputs: Sequence[torch.Tensor],
        config: CompilationConfig,
        weak_outputs: bool = False,
        runs_later: bool = False,
    ) -> DeviceGraph:
        assert not runs_later, "this platform makes its graphs at start-up only"
        graph = StaticGraph(name, fn, inputs, self.graph_decompositions())
        self.graphs_made.append(graph)
        self.captures.append((name, self.graph_pool()))
        self.weak_outputs.append(weak_outputs)
        return graph

    def available_kv_cache_memory(
        self, gpu_memory_utilization: float, used_bytes: int, num_local_ranks: int = 1
    ) -> int:
        return (64 << 20) // num_local_ranks


class NoGraphCpuPlatform(CpuPlatform):
    """A CPU platform that cannot capture graphs."""

    name: ClassVar[str] = "cpu-no-graphs"
    supports_graphs: ClassVar[bool] = False


@contextmanager
def registered_platform(platform: type[Platform], name: str | None = None) -> Iterator[str]:
    """`platform` registered (under its own name unless given) for the duration."""
    name = name or platform.name
    register_platform(name, platform)
    try:
        yield name
    finally:
        unregister_platform(name)


@contextmanager
def registered_backend(backend: type[AttentionBackend]) -> Iterator[str]:
    """`backend` registered under its `name` for the duration."""
    selector.register_backend(backend.name, backend)
    try:
        yield backend.name
    finally:
        selector.unregister_backend(backend.name)
