"""`Worker`: one rank's model runner, driven by the engine through an executor.

The engine and scheduler stay in the driver; each tensor-parallel rank has a worker (in
the driver's process at tensor_parallel_size 1, in a process or Ray actor of its own
above), and the executor calls its methods by name on every rank at once
(`Executor.collective_rpc`). What crosses is plain data: the scheduler's output and the
step's plan in, `ModelRunnerOutput` and start-up facts out (docs/design.md §8).

Every rank runs the same start-up in lockstep, since each of its forwards is a
collective: load its shard of the weights, profile, allocate the KV cache the driver
sized from every rank's budget, resolve the graph mode and capture its own graphs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from decodegraph.config import EngineConfig
from decodegraph.core.kv_cache_spec import KVCacheGroupSpec
from decodegraph.core.sched_output import ModelRunnerOutput, SchedulerOutput
from decodegraph.graphs.dispatcher import StepPlan
from decodegraph.graphs.graph_runner import CaptureStats
from decodegraph.graphs.modes import CUDAGraphMode
from decodegraph.platforms import get_platform
from decodegraph.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# A collective waits this long for the other ranks (DECODEGRAPH_DIST_TIMEOUT_S): long
# enough for one rank's graph compile to finish while another waits at the next
# collective; a dead rank is found at once by the executor's watchdog instead.
_DIST_TIMEOUT_S = 600.0


@dataclass
class KVCacheInfo:
    """What one rank tells the driver for sizing the KV cache (the driver takes the
    smallest budget over the ranks, so that every rank holds the same blocks)."""

    groups: list[KVCacheGroupSpec]
    bytes_per_block: list[int]  # per KV cache group, this rank's heads only
    # Bytes the cache may take here: the platform's budget less the attention workspace
    # and (with graphs) the profiled activation peak; None where the user gave a budget.
    available_bytes: int | None
    max_blocks_per_seq: int


@dataclass
class GraphInfo:
    """One rank's resolved graph mode and capture sizes; the driver's dispatcher is
    built from rank 0's and every rank's must be the same."""

    mode: CUDAGraphMode
    capture_sizes: list[int]
    max_num_reqs: int
    # Whether uniform decode batches above the capture sizes run the dynamic decode graph.
    dynamic_decode: bool
    reasons: list[str]  # why the mode differs from the requested one, a line each
    attention_backend: str  # the first attention group's backend, and its graph support
    attention_cudagraph_support: str


@dataclass
class RankInfo:
    """Who a rank is, for the start-up log."""

    rank: int
    local_rank: int
    pid: int
    host: str
    device: str
    threads: int


class Worker:
    """One rank: its device, its share of the model, its graphs."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.platform = get_platform(config.device_config.device)
        self.runner = None

    def init_device(self) -> None:
        """Set the device and process settings, join the tensor-parallel group, seed."""
        from decodegraph.worker.model_runner import ModelRunner

        mc, pc = self.config.model_config, self.config.parallel_config
        self.platform.set_device(self.local_rank)
        self.platform.configure_process()
        if pc.tensor_parallel_size > 1:
            from decodegraph.distributed.parallel_state import init_distributed_environment

            init_distributed_environment(
                pc.tensor_parallel_size,
                self.rank,
                self.distributed_init_method,
                self.platform.dist_backend,
                self.local_rank,
                timeout_s=float(os.environ.get("DECODEGRAPH_DIST_TIMEOUT_S", _DIST_TIMEOUT_S)),
            )
        torch.manual_seed(mc.seed)
        self.runner = ModelRunner(self.config, self.platform, mc.hf_config)

    def describe(self) -> RankInfo:
        return RankInfo(
            self.rank,
            self.local_rank,
            os.getpid(),
            os.uname().nodename,
            str(self.platform.device()),
            torch.get_num_threads(),
        )

    def init_structured_output(self, manager: StructuredOutputManager) -> None:
        """Rank 0 samples for every rank, so only it builds grammar masks: with the
        driver's manager where it shares the driver's process, else a copy of it
        (pickled without its compiled grammars: each process compiles a spec once)."""
        if self.rank == 0:
            self.runner.set_structured_output(manager)

    # ---------------------------------------------------------------- start-up

    def load_model(self) -> None:
        cc = self.config.compilation_config
        if not self.config.enforce_eager and cc.cudagraph_mode is not CUDAGraphMode.NONE:
            self.platform.prepare_graph_compile(cc)
        self.runner.load_model(self.config.model_config.model_path)

    def profile_run(self) -> None:
        self.runner.profile_run()

    def get_kv_cache_info(self) -> KVCacheInfo:
        cc, runner = self.config.cache_config, self.runner
        groups = runner.kv_cache_groups
        available = None
        if cc.num_gpu_blocks_override is None and cc.kv_cache_memory_bytes is None:
            available = self.platform.available_kv_cache_memory(
                cc.gpu_memory_utilization,
                self.platform.memory_allocated(),
                self.config.parallel_config.local_world_size,
            )
            available -= runner.workspace_bytes()
            if not self.config.enforce_eager:
                available -= runner.profile_peak_bytes
        return KVCacheInfo(
            groups,
            [runner.kv_cache_bytes_per_block(g) for g in range(len(groups))],
            available,
            runner.max_blocks_per_seq,
        )

    def initialize_kv_cache(self, num_blocks: list[int]) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def resolve_graph_mode(self) -> GraphInfo:
        gr = self.runner.graph_runner
        mode = gr.resolve()
        backend = self.runner.attn_backend
        return GraphInfo(
            mode,
            list(gr.capture_sizes),
            gr.max_num_reqs,
            gr.dynamic_key is not None,
            list(gr.mode_reasons),
            backend.name,
            backend.cudagraph_support.name,
        )

    def capture_graphs(self) -> CaptureStats:
        return self.runner.capture_graphs()

    # ---------------------------------------------------------------- per step

    def execute_model(self, so: SchedulerOutput, plan: StepPlan) -> ModelRunnerOutput | None:
        """Run one step as the driver planned it. Rank 0's output is the step's; the
        other ranks return None (they took rank 0's sampled tokens)."""
        out = self.runner.execute_model(so, plan)
        return out if self.rank == 0 else None

    def wait_for_background_graph(self) -> tuple[tuple[int, int] | None, list[int]]:
        return self.runner.wait_for_background_graph()

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.graph_runner is not None:
            self.runner.graph_runner.close()
        if self.config.parallel_config.tensor_parallel_size > 1:
            from decodegraph.distributed.parallel_state import destroy_distributed_environment

            destroy_distributed_environment()
