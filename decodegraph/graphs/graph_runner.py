"""The graph side of the model runner: sizes, mode, capture, replay (docs/design.md §3-4).

`GraphRunner` resolves the graph mode, decides which keys get captured, captures them
at start-up (largest first, into the platform's one memory pool, garbage collector
frozen, then closes capture), and per step dispatches a batch to a runtime mode and
key, refreshes the graph params of every attention group by name, and replays.

Every graph binds its inputs at capture: views of the persistent buffers, and for a
full graph every tensor its attention reads. A step writes its values into those
buffers before the replay; the first replay of each graph checks that the buffers the
step wrote are the ones it bound (always on: on a device a changed address silently
corrupts the output).

The platform makes the graphs (`Platform.make_graph` / `make_piece`); nothing here
depends on which platform that is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from decodegraph.attention.backends.base import AttentionBackend, AttentionMetadata
from decodegraph.forward_context import (
    EAGER_PARAMS_ID,
    BatchDescriptor,
    ForwardContext,
    set_forward_context,
)
from decodegraph.gc_utils import frozen_heap
from decodegraph.graphs.dispatcher import CudagraphDispatcher, StepPlan, StepPlanError, in_rows
from decodegraph.graphs.forked_build import forked_builds_enabled, run_forked
from decodegraph.graphs.modes import CUDAGraphMode, RuntimeMode, explain_cudagraph_mode
from decodegraph.graphs.multi_step import multi_step_forward
from decodegraph.graphs.piecewise import PiecewiseGraph
from decodegraph.platforms.base import DeviceGraph, GraphNotCached, Platform

if TYPE_CHECKING:
    from decodegraph.config import EngineConfig
    from decodegraph.worker.input_buffers import InputBuffers

logger = logging.getLogger(__name__)

GraphKey = tuple[RuntimeMode, BatchDescriptor]
# Writes a dummy batch for a key into the buffers; returns each attention group's
# metadata for it (the model runner's InputBatch.make_dummy).
PrepareDummy = Callable[[RuntimeMode, BatchDescriptor], dict[str, AttentionMetadata]]


# The name of the thread graphs are made on in the background (the dynamic decode graph,
# decode sizes made on demand).
BACKGROUND_BUILD_THREAD = "decodegraph-graph-build"


class CaptureClosedError(RuntimeError):
    """A graph capture was attempted after start-up."""


@dataclass
class CaptureStats:
    num_graphs: int = 0  # full graphs count 1, piecewise graphs count their pieces
    seconds: float = 0.0
    memory_bytes: int = 0
    by_mode: dict[str, int] = field(default_factory=dict)
    # (fewest, most) rows of the dynamic decode graph, where one was made.
    dynamic_decode_rows: tuple[int, int] | None = None
    # Where it is made on a thread of its own once a batch needs it: its rows, how it
    # went ("not needed yet", "building", "ready", "failed") and its seconds to build.
    dynamic_decode_planned_rows: tuple[int, int] | None = None
    dynamic_decode_build: str = ""
    dynamic_decode_build_seconds: float = 0.0
    # Full decode sizes made when a batch first needs them, on that thread: each one's
    # build as above ("not needed yet", "building", "ready", "failed").
    on_demand_builds: dict[int, str] = field(default_factory=dict)


class GraphRunner:
    """Owns every graph of one model runner, keyed by (runtime mode, batch descriptor)."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        buffers: InputBuffers,
        attn_groups: dict[str, AttentionBackend],
        eager_context: ForwardContext,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        sc = config.scheduler_config
        self.config = config
        self.compilation_config = config.compilation_config
        self.platform = platform
        self.buffers = buffers
        # Attention group name -> its backend; graph params are refreshed by name.
        self.attn_groups = attn_groups
        # The context steps run in (each layer's backend); captures bake a params id in.
        self._eager_context = eager_context
        self.max_num_reqs: int = sc.max_num_seqs
        # This rank's tensor-parallel rank (for errors) and the group's size.
        self.rank = rank
        self.world_size = world_size
        self.max_num_tokens: int = sc.max_num_batched_tokens
        self.mode = CUDAGraphMode.NONE
        # Why the mode differs from the requested one (one line per downgrade).
        self.mode_reasons: list[str] = []
        self.capture_sizes: list[int] = []
        self.dispatcher = CudagraphDispatcher(CUDAGraphMode.NONE, [])
        self.graphs: dict[GraphKey, DeviceGraph] = {}
        # A full graph's params id (baked into it; the same id in every group).
        self.graph_params: dict[BatchDescriptor, int] = {}
        self.closed = False
        self.stats = CaptureStats()
        # (step kind, runtime mode) -> steps dispatched; step kind is "decode" or "mixed".
        self.mode_counts: Counter[tuple[str, str]] = Counter()
        # Key -> its graph, its params id and whether its first replay's check ran. A key
        # names one graph: uniform keys are full graphs, mixed keys the mixed mode's.
        self._replays: dict[BatchDescriptor, _Replay] = {}
        # The forward context each graph was captured in, until capture_all finishes it.
        self._capture_contexts: dict[GraphKey, ForwardContext] = {}
        # Steps a multi-step decode graph runs (1: none are captured; docs/design.md §3).
        self.graph_num_steps = 1
        # (fewest, most) rows the dynamic decode graph serves, where one is planned; it
        # is made at start-up or, `dynamic_in_background`, on a thread of its own once a
        # batch needs it (the dispatcher sends batches to it only when it is made).
        self.dynamic_rows: tuple[int, int] | None = None
        self.dynamic_in_background = False
        # Full decode sizes made on demand (`decode_graphs_on_demand`), not at start-up.
        self.on_demand_sizes: list[int] = []
        # Graphs planned at start-up and made in the background, by key, until finished;
        # the thread that makes them, one at a time, and those it has yet to make.
        self._background: dict[BatchDescriptor, _BackgroundBuild] = {}
        self._build_thread: threading.Thread | None = None
        self._build_queue: list[_BackgroundBuild] = []
        self._build_lock = threading.Lock()
        # Uniform decode batch rows -> the planned graph that will serve them, while
        # none has asked for it (a dict lookup a step: its build starts at the first).
        self._unrequested: dict[int, _BackgroundBuild] = {}
        # Whether their compiles run first in a forked child (graphs/forked_build.py);
        # read here, so that a bad DECODEGRAPH_FORKED_GRAPH_BUILDS fails the start-up.
        self._forked_builds = (
            platform.supports_forked_builds
            and self.compilation_config.use_inductor
            and forked_builds_enabled()
        )
        # (group name, backend) pairs, in a tuple for the per-step loops.
        self._groups = tuple(attn_groups.items())

    # ---------------------------------------------------------------- start-up

    def resolve(self) -> CUDAGraphMode:
        """The mode this platform and these attention groups can run (every downgrade
        logged once, with its reason), and the dispatcher for it."""
        cc = self.compilation_config
        requested = CUDAGraphMode.NONE if self.config.enforce_eager else cc.cudagraph_mode
        self.mode, self.mode_reasons = explain_cudagraph_mode(
            requested,
            [backend.cudagraph_support for backend in self.attn_groups.values()],
            self.platform.supports_graphs,
        )
        self.capture_sizes = self._capture_sizes()
        self.dispatcher = CudagraphDispatcher(
            self.mode, self.capture_sizes, self.max_num_reqs, self._dynamic_decode()
        )
        self.dynamic_rows = self.dispatcher.dynamic_decode_rows
        self.dynamic_in_background = (
            self.dynamic_rows is not None and self.compilation_config.dynamic_decode_graph is None
        )
        if self.dynamic_in_background:
            self.dispatcher.dynamic_decode_rows = None  # until the graph is made
            self.stats.dynamic_decode_build = "not needed yet"
            self.stats.dynamic_decode_planned_rows = self.dynamic_rows
        self.graph_num_steps = self._graph_num_steps()
        self.on_demand_sizes = self._on_demand_sizes()
        self.dispatcher.defer_decode_sizes(self.on_demand_sizes)
        self.stats.on_demand_builds = dict.fromkeys(self.on_demand_sizes, "not needed yet")
        return self.mode

    @property
    def dynamic_key(self) -> BatchDescriptor | None:
        """The dynamic decode graph's key (its most rows), where one is planned."""
        rows = self.dynamic_rows
        return None if rows is None else BatchDescriptor(rows[1], rows[1], True)

    def _dynamic_decode(self) -> bool:
        """Whether uniform decode batches above the largest capture size may run one
        graph of dynamic rows: asked for (true), or left to the default (unset) on one
        rank, and made by this platform and every attention group. Why not is logged
        once: as a warning where it was asked for."""
        asked = self.compilation_config.dynamic_decode_graph
        if asked is False:
            return False
        log = logger.warning if asked else logger.debug
        if not self.platform.supports_dynamic_graphs:
            log(
                "compilation_config.dynamic_decode_graph: platform %s fixes every graph's "
                "shapes at capture; batches above the largest capture size run eagerly",
                self.platform.name,
            )
            return False
        fixed = [name for name, backend in self._groups if not backend.supports_dynamic_rows()]
        if fixed:
            log(
                "compilation_config.dynamic_decode_graph: attention group(s) %s bake the "
                "batch's shape into a graph; batches above the largest capture size run "
                "eagerly",
                ", ".join(fixed),
            )
            return False
        if asked is None and self.world_size > 1:
            # Every rank must switch to it in the same step: made at start-up only when
            # asked for.
            logger.info(
                "compilation_config.dynamic_decode_graph unset: under tensor parallelism "
                "batches above the largest capture size run eagerly (true builds the "
                "dynamic decode graph at start-up)"
            )
            return False
        return True

    def _on_demand_sizes(self) -> list[int]:
        """The full decode sizes made when a batch first needs them, on a thread of their
        own, rather than at start-up: every decode size but the smallest, where asked for
        (true) or left to the default (unset) with the platform's default sizes, on one
        rank whose platform makes graphs in the background. Why not, where asked for, is
        logged once as a warning."""
        asked = self.compilation_config.decode_graphs_on_demand
        sizes = [k.num_tokens for k in self.dispatcher.keys[RuntimeMode.FULL] if k.uniform]
        if asked is False or len(sizes) < 2:
            return []
        reason = None
        if not self.platform.supports_background_graphs:
            reason = f"platform {self.platform.name} makes its graphs at start-up only"
        elif self.world_size > 1:
            reason = "under tensor parallelism every rank must switch graphs in the same step"
        elif self.graph_num_steps > 1:
            reason = "multi-step graphs are made beside every decode size at start-up"
        if reason is not None:
            if asked:
                logger.warning("compilation_config.decode_graphs_on_demand: %s", reason)
            return []
        if asked is None and self.compilation_config.cudagraph_capture_sizes:
            return []  # sizes the user listed are made at start-up
        return sorted(sizes)[1:]

    def _graph_num_steps(self) -> int:
        """How many decode steps one graph runs: the scheduler's steps where a full decode
        graph can run them all with the argmax feeding the next step, else 1 (why not is
        logged once)."""
        steps = self.config.scheduler_config.num_scheduler_steps
        if steps == 1 or not self.compilation_config.multi_step_graphs:
            return 1
        reason = None
        if self.mode.decode_mode() is not RuntimeMode.FULL or not self.dispatcher.decode_sizes:
            reason = f"graph mode {self.mode.name} has no full decode graphs"
        elif self.world_size > 1:
            reason = "tensor parallelism samples on rank 0 and broadcasts"
        else:
            unsafe = [
                name for name, backend in self._groups if not backend.supports_multi_step_graphs()
            ]
            if unsafe:
                reason = f"attention group(s) {', '.join(unsafe)} cannot advance inside a graph"
        if reason is not None:
            logger.info("num_scheduler_steps=%d runs a graph per step: %s", steps, reason)
            return 1
        return steps

    def _capture_sizes(self) -> list[int]:
        """Token counts to capture: the listed sizes up to max_num_batched_tokens (mixed
        keys count tokens), or the platform's defaults up to max_num_seqs; decode keys
        are further limited to max_num_seqs by the dispatcher."""
        cc = self.compilation_config
        limit = self.max_num_tokens
        if not cc.cudagraph_capture_sizes:
            limit = min(limit, self.max_num_reqs)
        if cc.max_cudagraph_capture_size:
            limit = min(limit, cc.max_cudagraph_capture_size)
        sizes = [
            s
            for s in cc.cudagraph_capture_sizes or self.platform.default_capture_sizes
            if s <= limit
        ]
        # A default bucket list must contain its own maximum (a nano-vllm pitfall).
        if not cc.cudagraph_capture_sizes and cc.max_cudagraph_capture_size and limit not in sizes:
            sizes.append(limit)
        return sorted(set(sizes))

    def capture_all(self, model: torch.nn.Module, prepare_dummy: PrepareDummy) -> CaptureStats:
        """Capture every key the dispatcher can ask for (largest first, so later graphs
        reuse the pool's memory), then close capture."""
        if self.closed:
            raise CaptureClosedError("graphs are captured once, at start-up")
        keys = self.dispatcher.all_keys()
        later = [(RuntimeMode.FULL, BatchDescriptor(s, s, True)) for s in self.on_demand_sizes]
        keys = [k for k in keys if k not in later]
        if self.graph_num_steps > 1:  # after the others: a uniform key per decode size
            steps = self.graph_num_steps
            sizes = sorted(self.dispatcher.decode_sizes, reverse=True)
            keys += [(RuntimeMode.FULL, BatchDescriptor(s, s, True, steps)) for s in sizes]
        if self.dynamic_key is not None:  # the largest: first
            if self.dynamic_in_background:
                self._plan_background_build(self.dynamic_key, model, prepare_dummy)
            else:
                keys.insert(0, (RuntimeMode.FULL, self.dynamic_key))
        for _, key in later:
            self._plan_background_build(key, model, prepare_dummy)
        self._unrequested = {
            n: self._background[key]
            for n in range(1, self.max_num_reqs + 1)
            if (key := self._planned_key(n)) in self._background
        }
        memory_before = self.platform.memory_allocated()
        start = time.perf_counter()
        # A collection during capture makes it slow (vLLM #21146): collect now, then
        # keep what is left out of reach. Inside an engine's start-up (gc_utils) the
        # heap the engine started with is frozen already, so this walks only what
        # start-up made.
        gc.collect()
        with frozen_heap():
            for mode, key in tqdm(keys, desc="Capturing graphs", disable=not keys, leave=False):
                self.capture(mode, key, model, prepare_dummy)
            # In capture order on every rank: finishing runs a graph, collectives and all,
            # under the forward context it was captured in (an attention op may read it).
            for graph_key, graph in self.graphs.items():
                with set_forward_context(self._capture_contexts.pop(graph_key)):
                    graph.finish()
        self.closed = True
        if not self.dynamic_in_background:
            self.stats.dynamic_decode_rows = self.dispatcher.dynamic_decode_rows
        self.stats.seconds = time.perf_counter() - start
        self.stats.memory_bytes = max(0, self.platform.memory_allocated() - memory_before)
        if keys:
            logger.info(
                "Captured %d graphs (%s) in %.1f s, %.1f MiB",
                self.stats.num_graphs,
                ", ".join(f"{m}: {n}" for m, n in self.stats.by_mode.items()),
                self.stats.seconds,
                self.stats.memory_bytes / 2**20,
            )
        return self.stats

    @torch.inference_mode()
    def capture(
        self,
        mode: RuntimeMode,
        key: BatchDescriptor,
        model: torch.nn.Module,
        prepare_dummy: PrepareDummy,
    ) -> None:
        """Capture the graph for (mode, key) over a dummy batch of its shape."""
        if self.closed:
            raise CaptureClosedError(
                f"capture of {mode.name} {key} after start-up: graphs are captured only once"
            )
        if mode is RuntimeMode.NONE:
            raise ValueError(f"no graph to capture for runtime mode {mode.name}")
        name = f"{mode.name}{key.label()}"
        base = self._eager_context
        if mode is RuntimeMode.FULL:
            params_id, context = self._new_full_params(key, prepare_dummy)
            if key.num_steps > 1:
                params = [backend.params[params_id] for _, backend in self._groups]
                fn = multi_step_forward(model, params, self.buffers.block_size, key.num_steps)
            else:
                fn = self._forward_fn(model, logits=key.uniform)
            with set_forward_context(context):
                if key == self.dynamic_key:
                    graph = self._make_dynamic_graph(fn)
                    if graph is None:
                        return
                else:
                    # A step reads a full graph's outputs before the next replay: the pool
                    # may reuse their memory (largest first, so one size's logits at most).
                    graph = self.platform.make_graph(
                        name,
                        fn,
                        self.graph_inputs(mode, key),
                        self.compilation_config,
                        weak_outputs=True,
                    )
            count = 1
        else:
            metadata = prepare_dummy(mode, key)
            for group, backend in self._groups:
                backend.set_eager_metadata(metadata[group])
            context = dataclasses.replace(base, params_id=EAGER_PARAMS_ID, split_attention=True)
            with set_forward_context(context):
                graph = PiecewiseGraph(
                    name,
                    self._forward_fn(model, logits=False),
                    self.graph_inputs(mode, key),
                    self.platform,
                    self.compilation_config,
                )
            count = graph.num_pieces
            params_id = None  # piecewise: attention runs eagerly
        self._capture_contexts[(mode, key)] = context
        self._add(mode, key, graph, params_id, count)

    def _add(
        self,
        mode: RuntimeMode,
        key: BatchDescriptor,
        graph: DeviceGraph,
        params_id: int | None,
        count: int,
    ) -> None:
        """A made graph, replayed from now on for `key`."""
        self.graphs[(mode, key)] = graph
        self._replays[key] = _Replay(graph, params_id)
        self.stats.num_graphs += count
        self.stats.by_mode[mode.name] = self.stats.by_mode.get(mode.name, 0) + count

    def _new_full_params(
        self, key: BatchDescriptor, prepare_dummy: PrepareDummy
    ) -> tuple[int, ForwardContext]:
        """A dummy batch for full key `key` in the buffers, every attention group's
        params for it, and the context its graph is made in (its params id)."""
        metadata = prepare_dummy(RuntimeMode.FULL, key)
        # Every group's params get the same id (they are made in lockstep).
        ids = {backend.new_graph_params(metadata[group]) for group, backend in self._groups}
        if len(ids) != 1:
            raise RuntimeError(f"attention groups' graph params out of step: {ids}")
        params_id = self.graph_params[key] = ids.pop()
        return params_id, dataclasses.replace(self._eager_context, params_id=params_id)

    def _make_dynamic_graph(
        self, fn: Callable[..., Any], runs_later: bool = False
    ) -> DeviceGraph | None:
        """The dynamic decode graph, captured over the most rows (its params' metadata
        span them all; each step's host values say how many are live). None where the
        model's trace depends on where in the range the rows lie (logged once): those
        batches then run eagerly, and the dispatcher no longer sends them here."""
        key = self.dynamic_key
        assert key is not None and self.dynamic_rows
        fewest, most = self.dynamic_rows
        try:
            return self.platform.make_dynamic_graph(
                f"FULL(rows {fewest}-{most})",
                fn,
                self.graph_inputs(RuntimeMode.FULL, key)[:2],
                fewest,
                self.compilation_config,
                runs_later=runs_later,
            )
        except GraphNotCached:
            raise
        except Exception as e:  # noqa: BLE001 - any failed trace: run those batches eagerly
            self._no_dynamic_graph(e)
            return None

    def _no_dynamic_graph(self, error: BaseException) -> None:
        """Log why there is no dynamic decode graph; its batches stay eager."""
        assert self.dynamic_rows is not None
        logger.warning(
            "no dynamic decode graph for %d-%d requests (%s: %s); uniform decode batches "
            "above the largest capture size run eagerly",
            *self.dynamic_rows,
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        self.dispatcher.dynamic_decode_rows = None

    # ------------------------------------------------ graphs made in the background

    def _plan_background_build(
        self, key: BatchDescriptor, model: torch.nn.Module, prepare_dummy: PrepareDummy
    ) -> None:
        """At start-up, what the graph for full key `key` will need (its attention params,
        made here with the other graphs'), and nothing else: it is traced and compiled
        on a thread of its own when the first batch needs it (`dispatch`)."""
        params_id, context = self._new_full_params(key, prepare_dummy)
        self._background[key] = _BackgroundBuild(
            key, self._forward_fn(model, logits=True), params_id, context, prepare_dummy
        )

    def _request_build(self, build: _BackgroundBuild) -> None:
        """Have a planned graph made in the background: queued for the thread that makes
        them (started if none runs). Nothing there runs a graph or writes a buffer
        (`finish_background_build` does, between steps); the engine's steps go on
        meanwhile, those it will serve eagerly (or on a larger graph)."""
        self._unrequested = {n: b for n, b in self._unrequested.items() if b is not build}
        self._set_build_state(build.key, "building")
        with self._build_lock:
            self._build_queue.append(build)
            if self._build_thread is None:
                self.platform.before_background_graph()  # here, on the thread that steps
                self._build_thread = threading.Thread(
                    target=self._build_in_background, name=BACKGROUND_BUILD_THREAD, daemon=True
                )
                self._build_thread.start()
            build.thread = self._build_thread

    def _build_in_background(self) -> None:
        """The thread's loop: make each queued graph in turn until none is left."""
        with _quick_gil_handover(), torch.inference_mode():
            while True:
                with self._build_lock:
                    if not self._build_queue:
                        self._build_thread = None
                        return
                    build = self._build_queue.pop(0)
                if not build.cancelled:
                    self._make_in_background(build)

    def _make_in_background(self, build: _BackgroundBuild) -> None:
        start = time.perf_counter()
        try:
            graph, made = None, False
            if self._forked_builds:
                try:  # a module some earlier process compiled: loaded, nothing forked
                    with self.platform.cached_graphs_only(), set_forward_context(build.context):
                        graph = self._make_background_graph(build)
                    made = True  # (or a failed trace, logged: final either way)
                except GraphNotCached:
                    # The compile in a forked copy, off this process's GIL; made again
                    # below, the graph then loads its module (graphs/forked_build.py).
                    build.forked = run_forked(
                        lambda: self._build_in_child(build), build.is_cancelled
                    )
            if not made and not build.cancelled:
                with set_forward_context(build.context):
                    graph = self._make_background_graph(build)
            if graph is not None and not build.cancelled:
                graph.wait_built()
                build.graph = graph
        except Exception as e:  # noqa: BLE001 - reported by finish_background_build
            build.error = e
        build.seconds = time.perf_counter() - start
        build.done = True

    def _make_background_graph(self, build: _BackgroundBuild) -> DeviceGraph | None:
        if build.key == self.dynamic_key:
            return self._make_dynamic_graph(build.fn, runs_later=True)  # logs a failure
        return self.platform.make_graph(
            f"{RuntimeMode.FULL.name}{build.key.label()}",
            build.fn,
            self.graph_inputs(RuntimeMode.FULL, build.key),
            self.compilation_config,
            weak_outputs=True,
            runs_later=True,
        )

    def _build_in_child(self, build: _BackgroundBuild) -> bool:
        """In the forked child: the build, and the run over a dummy batch that the engine's
        thread would do (`_finish_build`), in the child's own copy of the buffers."""
        with set_forward_context(build.context):
            graph = self._make_background_graph(build)
        if graph is None:
            return False
        graph.wait_built()
        build.prepare_dummy(RuntimeMode.FULL, build.key)
        with torch.inference_mode(), set_forward_context(build.context):
            graph.finish()
        return True

    def join_background_build(self) -> None:
        """Wait until the graphs asked for in the background are made, where any are."""
        thread = self._build_thread
        if thread is not None:
            thread.join()

    def finish_background_build(self, prepare_dummy: PrepareDummy) -> list[BatchDescriptor]:
        """Between steps (the buffers free to write): each graph made in the background
        since the last call is run once over a dummy batch, as capture does, and the
        dispatcher sends its batches to it. Returns the keys made ready now; a graph that
        failed is logged, and its batches stay eager (or on a larger graph)."""
        made: list[BatchDescriptor] = []
        for key, build in list(self._background.items()):
            if not build.done:
                continue
            del self._background[key]
            if self._finish_build(build, prepare_dummy):
                made.append(key)
        return made

    def _finish_build(self, build: _BackgroundBuild, prepare_dummy: PrepareDummy) -> bool:
        key, dynamic = build.key, build.key == self.dynamic_key
        if dynamic:
            self.stats.dynamic_decode_build_seconds = build.seconds
        error = build.error
        if build.graph is not None and error is None:
            try:
                prepare_dummy(RuntimeMode.FULL, key)
                with torch.inference_mode(), set_forward_context(build.context):
                    build.graph.finish()
            except Exception as e:  # noqa: BLE001 - any failure: run those batches eagerly
                error = e
        if build.graph is None or error is not None:
            self._set_build_state(key, "failed")
            if dynamic and error is not None:  # (a failed trace has said why already)
                self._no_dynamic_graph(error)
            elif not dynamic:
                logger.warning(
                    "no graph for %d-request decode batches (%s: %s); they run on the next "
                    "larger graph, or eagerly",
                    key.num_tokens,
                    type(error).__name__,
                    str(error).splitlines()[0] if error is not None and str(error) else "",
                )
            return False
        self._add(RuntimeMode.FULL, key, build.graph, build.params_id, 1)
        self._set_build_state(key, "ready")
        if dynamic:
            self.dispatcher.dynamic_decode_rows = self.stats.dynamic_decode_rows = self.dynamic_rows
            logger.info(
                "dynamic decode graph for %d-%d requests made in the background in %.1f s%s",
                *self.dynamic_rows,
                build.seconds,
                " (compiled in a forked process)" if build.forked else "",
            )
        else:
            self.dispatcher.decode_size_made(key.num_tokens)
            logger.info(
                "graph for %d-request decode batches made in the background in %.1f s%s",
                key.num_tokens,
                build.seconds,
                " (compiled in a forked process)" if build.forked else "",
            )
        return True

    def _set_build_state(self, key: BatchDescriptor, state: str) -> None:
        if key == self.dynamic_key:
            self.stats.dynamic_decode_build = state
        else:
            self.stats.on_demand_builds[key.num_tokens] = state

    def close(self) -> None:
        """Stop the builds in the background: what is being made now ends, no other is
        started, and every graph planned there is dropped."""
        builds, self._background = list(self._background.values()), {}
        self._unrequested = {}
        for build in builds:
            build.cancelled = True
        self.join_background_build()

    @staticmethod
    def _forward_fn(model: torch.nn.Module, logits: bool) -> Callable[..., Any]:
        """The one forward every graph captures: hidden states, or for a uniform decode
        graph logits and greedy ids too (inside the graph the argmax is fused with the
        LM head; the sampler still gets the logits for everything else)."""
        if not logits:
            return lambda input_ids, positions, *_: model(input_ids, positions)

        def forward_with_logits(
            input_ids: torch.Tensor, positions: torch.Tensor, *_: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            out = model.compute_logits(model(input_ids, positions))
            return out, out.argmax(dim=-1)

        return forward_with_logits

    def multi_step_key(self, num_reqs: int, num_steps: int) -> BatchDescriptor | None:
        """The multi-step graph a greedy batch of `num_reqs` decoding requests and
        `num_steps` steps replays, or None where none was captured for it."""
        if num_steps != self.graph_num_steps or num_steps == 1:
            return None
        padded = self.dispatcher.padded_decode_size(num_reqs)
        return None if padded is None else BatchDescriptor(padded, padded, True, num_steps)

    def graph_inputs(self, mode: RuntimeMode, key: BatchDescriptor) -> list[torch.Tensor]:
        """What a graph binds: views of the persistent buffers (the model reads the first
        two; the rest are bound so that their addresses are checked too) and, for a full
        graph, every tensor its attention reads (AttentionBackend.graph_tensors)."""
        b, n = self.buffers, key.num_tokens
        inputs = [b.input_ids.gpu[:n], b.positions.gpu[:n], b.seq_lens.gpu, b.query_start_loc.gpu]
        for table in b.kv_groups:
            inputs += [table.slot_mapping.gpu[:n], table.block_table.gpu]
        if mode is RuntimeMode.FULL:
            params_id = self.graph_params[key]
            for backend in self.attn_groups.values():
                inputs += backend.graph_tensors(params_id)
        return inputs

    # ---------------------------------------------------------------- per step

    def dispatch(
        self, num_tokens: int, num_reqs: int, uniform: bool, plan: StepPlan | None = None
    ) -> StepPlan:
        """The runtime mode and padded key for a batch, counted per kind of step.

        With the driver's `plan` this rank's own decision must be the same: a rank whose
        graphs differ (other capture sizes, another mode) refuses the step rather than
        run eager while the others replay, or replay another size."""
        if self._unrequested and uniform:
            build = self._unrequested.get(num_reqs)
            if build is not None:  # the first batch a planned graph serves
                self._request_build(build)
        if plan is not None and self.world_size == 1:
            # The driver's dispatcher was built from this very rank's graphs.
            self.mode_counts[("decode" if uniform else "mixed", plan.mode.name)] += 1
            return plan
        own = self.dispatcher.dispatch(BatchDescriptor(num_tokens, num_reqs, uniform))
        if plan is not None and own != plan:
            raise StepPlanError(
                f"rank {self.rank}: the driver planned {plan.mode.name} {plan.key.label()} for "
                f"{num_reqs} requests, {num_tokens} tokens, but this rank's graphs give "
                f"{own.mode.name} {own.key.label()}"
            )
        self.mode_counts[("decode" if uniform else "mixed", own.mode.name)] += 1
        return own

    def _planned_key(self, num_reqs: int) -> BatchDescriptor:
        """The full key a uniform decode batch of `num_reqs` requests runs once every
        planned graph is made."""
        if in_rows(self.dynamic_rows, num_reqs):
            return self.dynamic_key  # type: ignore[return-value]
        size = self.dispatcher.planned_decode_size(num_reqs) or num_reqs
        return BatchDescriptor(size, size, True)

    def replay(
        self, mode: RuntimeMode, key: BatchDescriptor, metadata: dict[str, AttentionMetadata]
    ) -> Any:
        """Replay the graph for (mode, key) over what the step wrote into the buffers,
        with this step's attention metadata per group. Returns the graph's outputs:
        (logits, greedy ids) for a uniform full graph, the ids of every step [steps,
        rows] for a multi-step graph (`key.num_steps` > 1), hidden states otherwise."""
        rows = 0  # the dynamic decode graph's live rows; 0 for a graph of fixed rows
        if key.uniform and key.num_steps == 1 and self.dispatcher.covers_dynamic(key.num_tokens):
            rows, key = key.num_tokens, self.dynamic_key  # type: ignore[assignment]
        replay = self._replays[key]
        if not replay.checked:
            inputs = self.graph_inputs(mode, key)
            replay.graph.check_inputs(inputs[:2] if rows else inputs)
            replay.checked = True
        if replay.params_id is not None:
            for group, backend in self._groups:
                backend.update_graph_params(replay.params_id, metadata[group])
        else:
            for group, backend in self._groups:
                backend.set_eager_metadata(metadata[group])
        return replay.graph.replay_rows(rows) if rows else replay.graph.replay()


class _Replay:
    """What a step needs to replay one key's graph."""

    __slots__ = ("checked", "graph", "params_id")

    def __init__(self, graph: DeviceGraph, params_id: int | None) -> None:
        self.graph = graph
        # A full graph's params id; None for a piecewise graph (eager attention).
        self.params_id = params_id
        self.checked = False


# While a graph is made on a thread of its own, how soon (seconds) a thread that asks
# for the GIL gets it. A step lets the GIL go at each of its operators; at Python's
# default (5 ms) it would wait that long for it at each, while the build's Python runs.
_BUILD_SWITCH_INTERVAL_S = 1e-4
_handover_lock = threading.Lock()
_handover_users = 0
_handover_saved = 0.0


@contextlib.contextmanager
def _quick_gil_handover() -> Iterator[None]:
    """Python's switch interval at _BUILD_SWITCH_INTERVAL_S while any build runs (it is
    the process's), as it was after the last one ends."""
    global _handover_users, _handover_saved
    with _handover_lock:
        if _handover_users == 0:
            _handover_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_handover_saved, _BUILD_SWITCH_INTERVAL_S))
        _handover_users += 1
    try:
        yield
    finally:
        with _handover_lock:
            _handover_users -= 1
            if _handover_users == 0:
                sys.setswitchinterval(_handover_saved)


class _BackgroundBuild:
    """A full graph made on a thread of its own (GraphRunner): the dynamic decode graph,
    or a decode size made on demand."""

    def __init__(
        self,
        key: BatchDescriptor,
        fn: Callable[..., Any],
        params_id: int,
        context: ForwardContext,
        prepare_dummy: PrepareDummy,
    ) -> None:
        self.key = key
        self.fn = fn
        self.params_id = params_id
        self.context = context
        self.prepare_dummy = prepare_dummy
        # Whether a forked child compiled it first (graphs/forked_build.py).
        self.forked = False
        # The thread that makes it, once a batch asked for it.
        self.thread: threading.Thread | None = None
        self.graph: DeviceGraph | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        # Set last, by the thread: graph or error and seconds are final.
        self.done = False
        self.seconds = 0.0

    def is_cancelled(self) -> bool:
        return self.cancelled
