"""`EngineCore`: the scheduler, the dispatcher and the executor (vLLM's name).

It starts the workers (one per tensor-parallel rank, through the executor) in lockstep:
load, profile, size the KV cache from every rank's budget, resolve the graph mode and
capture; then each `step` schedules a batch, plans it (the one dispatcher: runtime mode
and padded key, the same for every rank), runs it on every rank and turns the runner's
output into per-request outputs. Tokens in, tokens out: text is the `LLMEngine`'s.

Requests come in as `EngineCoreRequest`s (plain, picklable data, already validated and
tokenized), so that the same calls work whether the core shares the `LLMEngine`'s
process or runs in one of its own (engine/core_proc.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from decodegraph.config import EngineConfig
from decodegraph.core.kv_cache_spec import SlidingWindowSpec
from decodegraph.core.kv_cache_utils import kv_cache_block_counts
from decodegraph.core.sched_output import EngineCoreOutput, SchedulerOutput
from decodegraph.core.scheduler import Scheduler
from decodegraph.executor.abstract import Executor
from decodegraph.forward_context import BatchDescriptor
from decodegraph.gc_utils import frozen_heap
from decodegraph.graphs.dispatcher import CudagraphDispatcher
from decodegraph.graphs.graph_runner import CaptureStats
from decodegraph.graphs.modes import CUDAGraphMode
from decodegraph.platforms.base import Platform
from decodegraph.request import Request, RequestStatus
from decodegraph.sampling_params import SamplingParams
from decodegraph.structured_output.manager import StructuredOutputManager
from decodegraph.worker.model_runner import ModelRunner
from decodegraph.worker.worker import GraphInfo, KVCacheInfo, RankInfo

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A step failed (a worker died or raised): the engine serves nothing any more."""


@dataclass(slots=True)
class EngineCoreRequest:
    """One sequence to schedule, as the front sends it (vLLM's name): validated and
    tokenized, with the engine's defaults (max_tokens, extra EOS ids) filled in."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float  # time.monotonic(): one clock for every process of the host


@dataclass
class EngineStats:
    """A snapshot for metrics and logs."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int  # usable blocks of the first KV cache group (the null block excluded)
    prompt_tokens_total: int
    generation_tokens_total: int
    # Runtime mode name -> steps run in it; and (step kind, mode) -> steps.
    graph_runs: dict[str, int] = field(default_factory=dict)
    mode_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineCore:
    """Schedules, plans and runs steps on the executor's workers."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        structured_output: StructuredOutputManager,
    ) -> None:
        mc, cc = config.model_config, config.cache_config
        self.config = config
        self.model_config = mc
        self.platform = platform
        # Set when a step failed; every later step raises EngineDeadError with it.
        self.dead: BaseException | None = None
        phases: dict[str, float] = {}
        start = last = time.perf_counter()

        def phase(name: str) -> None:
            nonlocal last
            now = time.perf_counter()
            phases[name] = now - last
            last = now

        # Start-up's collections walk only what start-up makes (gc_utils).
        with frozen_heap():
            self.executor: Executor = Executor.get_class(config)(config)
            driver_worker = getattr(self.executor, "driver_worker", None)
            if driver_worker is not None:
                self.platform = driver_worker.platform  # one instance per process
            try:
                self.ranks: list[RankInfo] = self.executor.collective_rpc("describe")
                self.executor.collective_rpc("init_structured_output", (structured_output,))
                self.executor.collective_rpc("load_model")
                phase("load")
                self.executor.collective_rpc("profile_run")
                phase("profile")
                num_blocks = self._num_kv_blocks(self.executor.collective_rpc("get_kv_cache_info"))
                self.executor.collective_rpc("initialize_kv_cache", (num_blocks,))
                phase("KV cache")
                graph_info = self._graph_info(self.executor.collective_rpc("resolve_graph_mode"))
                stats: list[CaptureStats] = self.executor.collective_rpc("capture_graphs")
                phase("capture")
            except BaseException:
                self.executor.shutdown()
                raise
        self.graph_info = graph_info
        self.graph_mode: CUDAGraphMode = graph_info.mode
        self.num_blocks_per_group = num_blocks
        # The one dispatcher of the engine: each step's plan, sent to every rank.
        # The dynamic decode graph where every rank made one (a rank whose trace failed
        # runs those batches eagerly; every rank traces the same model, so all or none).
        graph_info.dynamic_decode = all(s.dynamic_decode_rows is not None for s in stats)
        self.dispatcher = CudagraphDispatcher(
            graph_info.mode,
            graph_info.capture_sizes,
            graph_info.max_num_reqs,
            graph_info.dynamic_decode,
        )
        # Decode sizes made on demand (one rank): planned for from the step after each is.
        self.dispatcher.defer_decode_sizes(list(stats[0].on_demand_builds))
        # (step kind, runtime mode) -> steps; step kind is "decode" or "mixed".
        self.mode_counts: Counter[tuple[str, str]] = Counter()
        self.capture_stats = stats[0]
        # Start-up phases and their seconds, for logs and `decodegraph graphs`.
        self.startup_seconds = phases
        groups = self.kv_cache_groups
        logger.info(
            "Engine ready in %.1f s (%s): %s, KV blocks of %d tokens: %s; graph mode %s "
            "(%d graphs%s)",
            time.perf_counter() - start,
            ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()),
            mc.model,
            cc.block_size,
            ", ".join(f"{g.name} {n - 1}" for g, n in zip(groups, num_blocks, strict=True)),
            graph_info.mode.name,
            stats[0].num_graphs,
            " per rank" if len(stats) > 1 else "",
        )
        if len(self.ranks) > 1:
            logger.info(
                "Tensor parallel: %d ranks, executor %s, %s; %s",
                len(self.ranks),
                config.parallel_config.distributed_executor_backend,
                self.platform.dist_backend,
                "; ".join(
                    f"rank {r.rank} on {r.host} pid {r.pid} {r.device} ({r.threads} threads, "
                    f"{s.num_graphs} graphs)"
                    for r, s in zip(self.ranks, stats, strict=True)
                ),
            )
        self.scheduler = Scheduler(
            config.scheduler_config, cc, mc.max_model_len, num_blocks, groups
        )
        self._prompt_tokens_total = 0

    # ---------------------------------------------------------------- start-up

    def _num_kv_blocks(self, infos: list[KVCacheInfo]) -> list[int]:
        """KV blocks per KV cache group, the same on every rank: `num_gpu_blocks_override`
        each when given; else `kv_cache_memory_bytes` (a rank's), or the smallest of
        the ranks' budgets (the platform's, less the attention workspace and the graph
        pool, allocated after the KV cache), shared out between the groups
        (core/kv_cache_utils.py)."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        info = infos[0]
        groups = self.kv_cache_groups = info.groups
        per_block = info.bytes_per_block
        if cc.num_gpu_blocks_override is not None:
            counts = [cc.num_gpu_blocks_override] * len(groups)
        else:
            if cc.kv_cache_memory_bytes is not None:
                budget = cc.kv_cache_memory_bytes
            else:
                budget = min(i.available_bytes for i in infos)
            counts = kv_cache_block_counts(
                groups,
                per_block,
                budget,
                sc.max_num_seqs,
                sc.max_num_batched_tokens,
                self.model_config.max_model_len,
            )
        needed = info.max_blocks_per_seq + 1  # one full-length sequence plus the null block
        for group, count, size in zip(groups, counts, per_block, strict=True):
            if isinstance(group.spec, SlidingWindowSpec) or count >= needed:
                continue
            field_name = (
                "num_gpu_blocks_override"
                if cc.num_gpu_blocks_override is not None
                else "kv_cache_memory_bytes"
                if cc.kv_cache_memory_bytes is not None
                else "gpu_memory_utilization"
            )
            raise ValueError(
                f"{field_name}: the KV cache holds {count} blocks of {cc.block_size} "
                f"tokens, but max_model_len={self.model_config.max_model_len} needs {needed} "
                f"(each block is {size} bytes); raise the budget or lower max_model_len"
            )
        return counts

    @staticmethod
    def _graph_info(infos: list[GraphInfo]) -> GraphInfo:
        """Rank 0's resolved mode and sizes; every rank must have resolved the same."""
        for rank, info in enumerate(infos[1:], start=1):
            first = infos[0]
            if (info.mode, info.capture_sizes, info.dynamic_decode) != (
                first.mode,
                first.capture_sizes,
                first.dynamic_decode,
            ):
                raise RuntimeError(
                    f"rank {rank} resolved graph mode {info.mode.name} with capture sizes "
                    f"{info.capture_sizes} (dynamic decode graph: {info.dynamic_decode}), "
                    f"rank 0 {first.mode.name} with {first.capture_sizes} (dynamic decode "
                    f"graph: {first.dynamic_decode}): every rank must replay the same graphs"
                )
        return infos[0]

    @property
    def runner(self) -> ModelRunner:
        """The model runner, where it shares this process (tensor_parallel_size 1)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.dead}") from self.dead
        worker = getattr(self.executor, "driver_worker", None)
        if worker is None:
            raise AttributeError(
                "the model runners live in the executor's worker processes "
                f"(tensor_parallel_size {self.config.parallel_config.tensor_parallel_size})"
            )
        return worker.runner

    # ---------------------------------------------------------------- requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue one sequence for the scheduler."""
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time,
            )
        )
        self._prompt_tokens_total += len(request.prompt_token_ids)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish sequences (aborted, or stopped by a stop string the front matched);
        unknown or finished ids are ignored."""
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        """The scheduler's, the KV cache's and the graphs' counters now."""
        kv = self.scheduler.kv_cache_manager
        graph_runs: dict[str, int] = {}
        for (_, mode), count in self.mode_counts.items():
            graph_runs[mode] = graph_runs.get(mode, 0) + count
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.scheduler.kv_cache_usage,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks[0],
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self.scheduler.num_generated_tokens,
            graph_runs=graph_runs,
            mode_counts=dict(self.mode_counts),
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )

    # ---------------------------------------------------------------- the step

    def get_output(self) -> list[EngineCoreOutput]:
        """One step's per-request outputs (`step` without its SchedulerOutput)."""
        return self.step()[1]

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """Schedule one batch, plan it, run it on every rank; the per-request outputs
        (none when nothing was scheduled)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.dead}") from self.dead
        sched_out = self.scheduler.schedule()
        num_tokens = sched_out.total_num_scheduled_tokens
        if num_tokens == 0:
            return sched_out, []
        num_reqs = sched_out.num_reqs
        uniform = num_tokens == num_reqs
        plan = self.dispatcher.dispatch(BatchDescriptor(num_tokens, num_reqs, uniform))
        self.mode_counts[("decode" if uniform else "mixed", plan.mode.name)] += sched_out.num_steps
        try:
            runner_out = self.executor.execute_model(sched_out, plan)
        except BaseException as e:
            self._fail(e)
            raise
        if runner_out.dynamic_decode_rows is not None or runner_out.decode_sizes_made:
            self._graphs_made(runner_out.dynamic_decode_rows, runner_out.decode_sizes_made)
        return sched_out, self.scheduler.update_from_output(sched_out, runner_out)

    def wait_for_background_graph(self) -> None:
        """Between steps: wait for the graphs being made in the background (one rank), and
        plan their batches from the next step (benchmarks and tests: an engine does not
        wait for them)."""
        made = self.executor.collective_rpc("wait_for_background_graph")
        if all(m == made[0] for m in made):
            self._graphs_made(*made[0])

    def _graphs_made(self, dynamic_rows: tuple[int, int] | None, sizes: list[int]) -> None:
        """Graphs made in the background (one rank) serve from the next step."""
        if dynamic_rows is not None:
            self.dispatcher.dynamic_decode_rows = dynamic_rows
        for size in sizes:
            self.dispatcher.decode_size_made(size)

    def _fail(self, error: BaseException) -> None:
        """After a failed step: no step runs again, and the workers are stopped (a rank
        may be waiting in a collective for one that is gone)."""
        self.dead = error
        logger.error("step failed, the engine stops: %s", error)
        self.executor.shutdown()

    def check_health(self) -> None:
        """Raise EngineDeadError once a step failed or a worker is gone."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed: {self.dead}")
        try:
            self.executor.check_health()
        except Exception as e:
            self._fail(e)
            raise EngineDeadError(f"the engine failed: {e}") from e

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        self.executor.shutdown()
