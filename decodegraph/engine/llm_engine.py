"""The synchronous engine: requests in, one scheduled and executed step at a time.

step():  scheduler.schedule() -> dispatcher (the step's plan) ->
         executor.execute_model() (every rank's model runner) ->
         scheduler.update_from_output() -> output_processor (detokenize, stop strings)

The engine lives in the driver; the model runners live in the executor's workers (in
this process at tensor_parallel_size 1). The driver's dispatcher decides each step's
runtime mode and padded key once, and every rank runs that plan (docs/design.md §8).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decodegraph.config import EngineConfig
from decodegraph.core.kv_cache_spec import SlidingWindowSpec
from decodegraph.core.kv_cache_utils import kv_cache_block_counts
from decodegraph.core.scheduler import Scheduler
from decodegraph.engine.arg_utils import EngineArgs, UsageContext
from decodegraph.engine.output_processor import OutputProcessor
from decodegraph.executor.abstract import Executor
from decodegraph.forward_context import BatchDescriptor
from decodegraph.graphs.dispatcher import CudagraphDispatcher
from decodegraph.graphs.graph_runner import CaptureStats
from decodegraph.graphs.modes import CUDAGraphMode
from decodegraph.outputs import RequestOutput
from decodegraph.platforms import get_platform
from decodegraph.request import Request, RequestStatus
from decodegraph.sampling_params import SamplingParams
from decodegraph.structured_output.manager import StructuredOutputManager
from decodegraph.tokenizer import get_tokenizer
from decodegraph.worker.model_runner import ModelRunner
from decodegraph.worker.worker import GraphInfo, KVCacheInfo, RankInfo

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


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


class EngineDeadError(RuntimeError):
    """A step failed (a worker died or raised): the engine serves nothing any more."""


class LLMEngine:
    """Owns the tokenizer, scheduler, dispatcher, executor and output processor."""

    def __init__(self, config: EngineConfig) -> None:
        mc, cc = config.model_config, config.cache_config
        self.config = config
        self.model_config = mc
        self.platform = get_platform(config.device_config.device)
        self.platform.check_and_update_config(config)
        torch.manual_seed(mc.seed)
        self.tokenizer = get_tokenizer(mc, mc.model_path)
        self.eos_token_id, self.extra_eos_token_ids = self._eos_token_ids()
        eos_ids = [self.eos_token_id, *self.extra_eos_token_ids]
        self.structured_output = StructuredOutputManager(
            self.tokenizer,
            mc.hf_config.vocab_size,
            [t for t in eos_ids if t is not None],
            config.structured_outputs_config,
        )
        self.vocab_size: int = mc.hf_config.vocab_size
        # Set when a step failed; every later step raises EngineDeadError with it.
        self.dead: BaseException | None = None
        phases: dict[str, float] = {}
        start = last = time.perf_counter()

        def phase(name: str) -> None:
            nonlocal last
            now = time.perf_counter()
            phases[name] = now - last
            last = now

        self.executor: Executor = Executor.get_class(config)(config)
        driver_worker = getattr(self.executor, "driver_worker", None)
        if driver_worker is not None:
            self.platform = driver_worker.platform  # one instance per process
        try:
            self.ranks: list[RankInfo] = self.executor.collective_rpc("describe")
            self.executor.collective_rpc("init_structured_output", (self.structured_output,))
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
        self.dispatcher = CudagraphDispatcher(
            graph_info.mode, graph_info.capture_sizes, graph_info.max_num_reqs
        )
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
        self.output_processor = OutputProcessor(self.tokenizer)
        self._prompt_tokens_total = 0

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT
    ) -> LLMEngine:
        return cls(engine_args.create_engine_config(usage_context))

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
            if (info.mode, info.capture_sizes) != (infos[0].mode, infos[0].capture_sizes):
                raise RuntimeError(
                    f"rank {rank} resolved graph mode {info.mode.name} with capture sizes "
                    f"{info.capture_sizes}, rank 0 {infos[0].mode.name} with "
                    f"{infos[0].capture_sizes}: every rank must replay the same graphs"
                )
        return infos[0]

    @property
    def runner(self) -> ModelRunner:
        """The model runner, where it shares this process (tensor_parallel_size 1)."""
        worker = getattr(self.executor, "driver_worker", None)
        if worker is None:
            raise AttributeError(
                "the model runners live in the executor's worker processes "
                f"(tensor_parallel_size {self.config.parallel_config.tensor_parallel_size})"
            )
        return worker.runner

    def _eos_token_ids(self) -> tuple[int | None, list[int]]:
        """The model's EOS id and any further ones it lists.

        Instruct models often list several (Llama 3.x: end_of_text, eom_id, eot_id) in
        config.json or generation_config.json; as in vLLM, the first is the EOS and the
        others act as stop token ids of every request that does not ignore EOS.
        """
        ids: list[int] = []
        for eos in (
            getattr(self.model_config.hf_config, "eos_token_id", None),
            self._generation_config().get("eos_token_id"),
        ):
            for t in eos if isinstance(eos, (list, tuple)) else [eos]:
                if isinstance(t, int) and t not in ids:
                    ids.append(t)
        if not ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return (ids[0] if ids else None), ids[1:]

    def _generation_config(self) -> dict:
        path = self.model_config.model_path
        file = Path(path) / "generation_config.json" if path is not None else None
        if file is None or not file.is_file():
            return {}
        try:
            return json.loads(file.read_text())
        except (OSError, ValueError) as e:
            logger.warning("Ignoring unreadable %s: %s", file, e)
            return {}

    # ---------------------------------------------------------------- requests

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer (skip_tokenizer_init is set)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt: expected str, token ids or a dict, got {type(prompt).__name__}")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError and changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params: expected SamplingParams, got {type(params).__name__}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop: stop strings need a tokenizer to match text (skip_tokenizer_init is "
                "set); use stop_token_ids"
            )
        if params.structured_outputs is not None:
            # Compiled (and cached) now, so an invalid spec fails before anything is queued.
            self.structured_output.compile(params.structured_outputs)
        text, ids = self._tokenize(prompt)
        max_len, vocab = self.model_config.max_model_len, self.vocab_size
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids: every token id must be an int in [0, {vocab})")
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= vocab)
            if bad:
                raise ValueError(
                    f"logit_bias: token id(s) {bad} are out of vocabulary [0, {vocab})"
                )
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within "
                f"max_model_len={max_len}"
            )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_ids = (
            [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        )
        children = []
        for i, child_id in enumerate(child_ids):
            child_params = params if params.n == 1 else params.for_child(i)
            extra_eos = []
            if not child_params.ignore_eos:
                extra_eos = [
                    t for t in self.extra_eos_token_ids if t not in child_params.stop_token_ids
                ]
            if child_params.max_tokens is None or extra_eos:
                child_params = child_params.clone()  # never change the caller's object
                if child_params.max_tokens is None:
                    child_params.max_tokens = max_len - len(ids)
                child_params.stop_token_ids += extra_eos
            children.append(
                Request(
                    request_id=child_id,
                    prompt_token_ids=ids,
                    sampling_params=child_params,
                    eos_token_id=self.eos_token_id,
                    arrival_time=arrival,
                )
            )
        self.output_processor.add_request(request_id, text, ids, params, child_ids, arrival)
        for child in children:
            self.scheduler.add_request(child)
        self._prompt_tokens_total += len(ids) * len(children)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort parent requests (their children too); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            children = self.output_processor.child_ids(rid)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ---------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the outputs of requests that progressed."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.dead}") from self.dead
        sched_out = self.scheduler.schedule()
        num_tokens = sched_out.total_num_scheduled_tokens
        if num_tokens == 0:
            return []
        num_reqs = sched_out.num_reqs
        uniform = num_tokens == num_reqs
        plan = self.dispatcher.dispatch(BatchDescriptor(num_tokens, num_reqs, uniform))
        self.mode_counts[("decode" if uniform else "mixed", plan.mode.name)] += 1
        try:
            runner_out = self.executor.execute_model(sched_out, plan)
        except BaseException as e:
            self._fail(e)
            raise
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.reqs_to_abort:
            self.scheduler.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        return processed.request_outputs

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

    # ---------------------------------------------------------------- introspection

    def get_stats(self) -> EngineStats:
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

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """Render `messages` with the model's (or the given) chat template; `tools`
        (OpenAI's function dicts) go to the template as its `tools`."""
        if self.tokenizer is None:
            raise ValueError("messages: chat needs a tokenizer (skip_tokenizer_init is set)")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                "chat_template: this model's tokenizer has no chat template; pass one "
                "(chat_template=... / --chat-template)"
            )
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools,
        )
