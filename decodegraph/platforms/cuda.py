"""NVIDIA GPUs: graphs are torch.cuda.CUDAGraph sharing one memory pool."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils import _pytree as pytree

from decodegraph.platforms.base import DeviceGraph, GraphFn, Platform

if TYPE_CHECKING:
    from decodegraph.config import CompilationConfig, EngineConfig


def unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that does not keep it allocated (vLLM's
    weak_ref_tensor): valid while whatever owns that memory (a graph pool) keeps it."""
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes()
    )
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    return view.set_(storage, t.storage_offset(), t.shape, t.stride())


class CudaGraph(DeviceGraph):
    """A torch.cuda.CUDAGraph over bound input buffers, in a shared memory pool.

    Warm-ups and the capture run on one side stream (as vLLM's `graph_capture()`): the
    warm-up then runs the very code the capture records, on the stream it records from.
    """

    def __init__(
        self,
        name: str,
        fn: GraphFn,
        inputs: Sequence[torch.Tensor],
        pool: object | None,
        num_warmups: int,
        stream: torch.cuda.Stream,
        weak_outputs: bool = False,
    ) -> None:
        super().__init__(name, inputs)
        self._graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(num_warmups):
                fn(*self.inputs)
            stream.synchronize()
            with torch.cuda.graph(self._graph, pool=pool, stream=stream):
                output = fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # Weak: the outputs' memory goes back to the pool now, for the next capture.
        self._output = (
            pytree.tree_map_only(torch.Tensor, unowned, output) if weak_outputs else output
        )

    def _run(self) -> Any:
        self._graph.replay()
        return self._output


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"
    supports_graphs: ClassVar[bool] = True
    default_capture_sizes: ClassVar[list[int]] = [1, 2, 4] + list(range(8, 257, 8))
    # vLLM's defaults for chunked prefill on large GPUs.
    default_max_num_batched_tokens: ClassVar[dict[str, int]] = {
        "LLM_CLASS": 16384,
        "OPENAI_API_SERVER": 8192,
    }

    def __init__(self) -> None:
        self._pool: object | None = None
        self._capture_stream: torch.cuda.Stream | None = None

    def check_and_update_config(self, config: EngineConfig) -> None:
        cc = config.compilation_config
        mode = getattr(cc.cudagraph_mode, "name", cc.cudagraph_mode)  # an enum by now
        graphs = not config.enforce_eager and mode not in (None, "NONE")
        if graphs and cc.cudagraph_num_of_warmups < 1:
            # The first run of a Triton kernel compiles it; inside a capture that would
            # be recorded or fail, so every graph is warmed up before it is captured.
            raise ValueError(
                "compilation_config.cudagraph_num_of_warmups: must be at least 1 on CUDA "
                f"(got {cc.cudagraph_num_of_warmups}); kernels must be compiled before a "
                "graph is captured"
            )

    @property
    def default_attention_backend(self) -> str:  # type: ignore[override]
        """TRITON_ATTN (split-KV decode, full graphs for any batch) where triton is
        installed; else the torch-op fallback, graph-safe for uniform decode only."""
        return "TRITON_ATTN" if importlib.util.find_spec("triton") is not None else "CUDA_TORCH"

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def graph_pool(self) -> object:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def make_graph(
        self,
        name: str,
        fn: GraphFn,
        inputs: Sequence[torch.Tensor],
        config: CompilationConfig,
        weak_outputs: bool = False,
        runs_later: bool = False,
    ) -> DeviceGraph:
        if runs_later:
            raise NotImplementedError("a CUDA graph is captured on the thread that steps")
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        return CudaGraph(
            name,
            fn,
            inputs,
            self.graph_pool(),
            config.cudagraph_num_of_warmups,
            self._capture_stream,
            weak_outputs,
        )

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def available_kv_cache_memory(
        self, gpu_memory_utilization: float, used_bytes: int, num_local_ranks: int = 1
    ) -> int:
        free, total = torch.cuda.mem_get_info()
        # The budget is a share of the whole device; what the process already holds
        # (weights, profiled activations, graph pool) comes out of it.
        return max(0, int(total * gpu_memory_utilization) - (total - free))

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()
