"""The graph runner on a real engine (stories260K): capture with dummy lengths, largest
first into one pool, capture closed after start-up, replay over the persistent buffers
(a step that does not refresh one gives wrong ids), graph params refreshed before each
replay, padded rows writing no KV, addresses checked on first replay; the dynamic decode
graph (batches above the capture sizes), and its fallback where it cannot be made."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from decodegraph.entrypoints.llm import LLM
from decodegraph.forward_context import EAGER_PARAMS_ID, BatchDescriptor, get_forward_context
from decodegraph.graphs.graph_runner import CaptureClosedError, GraphRunner
from decodegraph.graphs.modes import RuntimeMode
from decodegraph.platforms.base import InputAddressError
from decodegraph.worker.input_buffers import PersistentBuffer
from tests.utils.inductor import count_compiles
from tests.utils.kv import changed_slots
from tests.utils.platforms import StaticGraph, StaticGraphPlatform, registered_platform
from tests.utils.requests import greedy

GREEDY = greedy(24)
PROMPTS = [[1, 50, 60], [1, 70, 80, 90, 100], [1, 33]]


def _llm(
    stories_dir: Path, mode: str, sizes: list[int], dynamic: bool = False, **kwargs: object
) -> LLM:
    """A small engine; its graphs are the listed sizes' only, unless `dynamic`."""
    return LLM(
        str(stories_dir),
        compilation_config={
            "cudagraph_mode": mode,
            "cudagraph_capture_sizes": sizes,
            "use_inductor": False,
            "dynamic_decode_graph": dynamic,
        },
        max_model_len=128,
        max_num_seqs=8,
        **kwargs,
    )


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def eager_llm(stories_dir: Path) -> LLM:
    return LLM(str(stories_dir), enforce_eager=True, max_model_len=128, max_num_seqs=8)


# ---------------------------------------------------------------- capture


def test_capture_uses_dummy_lengths_of_one(stories_dir: Path) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4])
    runner = llm.llm_engine.runner
    graph_params = [md for md in runner.attn_backend.params[EAGER_PARAMS_ID + 1 :]]
    assert len(graph_params) == runner.graph_runner.stats.num_graphs == 3
    for md in graph_params:
        assert md.max_seq_len == 1
        assert md.seq_lens_cpu == [1] * md.num_reqs
        assert md.seq_lens_host[: md.num_reqs].tolist() == [1] * md.num_reqs


def test_capture_runs_largest_first_into_the_platforms_one_pool(stories_dir: Path) -> None:
    with registered_platform(StaticGraphPlatform) as device:
        llm = _llm(stories_dir, "FULL_AND_PIECEWISE", [1, 2, 4], device=device)
    platform = llm.llm_engine.platform
    sizes = [int(name.split("(")[1].split(",")[0]) for name, _ in platform.captures]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 4
    assert {pool for _, pool in platform.captures} == {platform.graph_pool()}


def test_full_graphs_let_the_pool_reuse_their_outputs_and_pieces_do_not(
    stories_dir: Path,
) -> None:
    """A full graph's logits are read before the next replay, so their memory may go
    back to the pool (one size's logits held at most, not every size's side by side);
    a piece's outputs are the next piece's inputs and must stay allocated."""
    with registered_platform(StaticGraphPlatform) as device:
        llm = _llm(stories_dir, "FULL_AND_PIECEWISE", [1, 2, 4], device=device)
    platform = llm.llm_engine.platform
    weak = {name: w for (name, _), w in zip(platform.captures, platform.weak_outputs, strict=True)}
    full = {name for name in weak if name.startswith("FULL(")}
    assert len(full) == 3
    assert all(weak[name] for name in full)
    assert not any(weak[name] for name in set(weak) - full)


def test_capture_freezes_the_garbage_collector_during_capture_only(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    frozen: list[int] = []
    capture = GraphRunner.capture

    def spy(self, *args: object, **kwargs: object) -> None:  # noqa: ANN001
        frozen.append(gc.get_freeze_count())
        capture(self, *args, **kwargs)

    monkeypatch.setattr(GraphRunner, "capture", spy)
    before = gc.get_freeze_count()
    _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2])
    assert len(frozen) == 2 and all(count > 0 for count in frozen)
    assert gc.get_freeze_count() == before


def test_capture_finishes_every_graph_once_all_are_made_in_capture_order(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A platform may leave a graph building (the CPU's C++ compiler runs while the next
    size is lowered); capture waits for each before it returns, in the order made, which
    is the same on every rank."""
    events: list[tuple[str, str]] = []
    make_graph = StaticGraphPlatform.make_graph

    def made(self: StaticGraphPlatform, name: str, *args: object, **kwargs: object) -> object:
        events.append(("make", name))
        return make_graph(self, name, *args, **kwargs)

    monkeypatch.setattr(StaticGraphPlatform, "make_graph", made)
    monkeypatch.setattr(StaticGraph, "finish", lambda self: events.append(("finish", self.name)))
    with registered_platform(StaticGraphPlatform) as device:
        _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4], device=device)
    names = [name for event, name in events if event == "make"]
    assert len(names) == 3
    assert events == [("make", n) for n in names] + [("finish", n) for n in names]


def test_each_graph_is_finished_in_the_forward_context_it_was_captured_in(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finishing runs the graph once; an attention op that reads the forward context as it
    runs (the Triton backend's) must find the graph's own params id there, as at capture."""
    seen: list[tuple[str, int | None]] = []

    def finish(self: StaticGraph) -> None:
        context = get_forward_context()
        seen.append((self.name, None if context is None else context.params_id))

    monkeypatch.setattr(StaticGraph, "finish", finish)
    with registered_platform(StaticGraphPlatform) as device:
        llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4], device=device)
    graph_runner = llm.llm_engine.runner.graph_runner
    expected = {
        graph.name: graph_runner.graph_params[key]
        for (_, key), graph in graph_runner.graphs.items()
    }
    assert len(seen) == 3 and dict(seen) == expected
    assert get_forward_context() is None


def test_a_late_capture_raises(stories_dir: Path) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2])
    runner = llm.llm_engine.runner
    graph_runner = runner.graph_runner
    assert graph_runner.closed and graph_runner.stats.seconds > 0
    with pytest.raises(CaptureClosedError):
        graph_runner.capture(
            RuntimeMode.FULL, BatchDescriptor(1, 1, True), runner.model, runner._prepare_dummy
        )
    with pytest.raises(CaptureClosedError):
        runner.capture_graphs()


def test_there_is_no_graph_to_capture_for_mode_none(stories_dir: Path) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1])
    runner = llm.llm_engine.runner
    runner.graph_runner.closed = False
    with pytest.raises(ValueError, match="NONE"):
        runner.graph_runner.capture(
            RuntimeMode.NONE, BatchDescriptor(1, 1, True), runner.model, runner._prepare_dummy
        )


# ---------------------------------------------------------------- replay


def test_replay_runs_none_of_the_model_python(stories_dir: Path, eager_llm: LLM) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4])
    calls: list[int] = []
    llm.llm_engine.runner.model.register_forward_pre_hook(lambda *_: calls.append(1))
    assert _greedy(llm, PROMPTS) == _greedy(eager_llm, PROMPTS)
    counts = llm.llm_engine.runner.graph_runner.mode_counts
    assert counts[("decode", "FULL")] == GREEDY.max_tokens - 1
    assert len(calls) == sum(n for (_, mode), n in counts.items() if mode == "NONE")


@pytest.mark.parametrize("buffer", ["input_ids", "positions", "slot_mapping"])
@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "PIECEWISE"])
def test_a_step_that_does_not_refresh_a_static_buffer_gives_wrong_ids(
    stories_dir: Path,
    eager_llm: LLM,
    monkeypatch: pytest.MonkeyPatch,
    buffer: str,
    mode: str,
) -> None:
    """Replay takes no inputs: a CPU graph reads what the step wrote into the buffers it
    bound at capture, exactly as a device graph does. A step that leaves one of them
    with the previous step's values (here: every decode step after the first) replays
    over stale inputs."""
    llm = _llm(stories_dir, mode, [1, 2, 4])
    runner = llm.llm_engine.runner
    prepare = runner._prepare_inputs
    stale = getattr(runner.buffers, buffer).np
    previous: list[np.ndarray] = []

    def forgetful(so, states, plan):  # noqa: ANN001, ANN202
        batch = prepare(so, states, plan)
        n = batch.num_tokens
        if batch.runtime_mode is not RuntimeMode.NONE and batch.uniform_decode:
            if previous and len(previous[0]) == n:
                stale[:n] = previous[0]  # as if this step had not written it
            previous[:] = [stale[:n].copy()]
        return batch

    monkeypatch.setattr(runner, "_prepare_inputs", forgetful)
    prompts = PROMPTS[:1]
    assert _greedy(llm, prompts) != _greedy(eager_llm, prompts)
    assert runner.graph_runner.mode_counts[("decode", mode.split("_")[0])] > 0


def test_skipping_update_graph_params_gives_wrong_output(
    stories_dir: Path, eager_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proof that the mechanism matters: graphs replay with their capture-time lengths."""
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4])
    backend = llm.llm_engine.runner.attn_backend
    monkeypatch.setattr(backend, "update_graph_params", lambda params_id, metadata: None)
    prompts = PROMPTS[:1]
    assert _greedy(llm, prompts) != _greedy(eager_llm, prompts)
    assert llm.llm_engine.runner.graph_runner.mode_counts[("decode", "FULL")] > 0


def test_graph_params_are_refreshed_by_group_name(
    stories_dir: Path, eager_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4])
    graph_runner = llm.llm_engine.runner.graph_runner
    ((group, backend),) = graph_runner.attn_groups.items()
    seen: list[tuple[int, int]] = []
    update = backend.update_graph_params
    monkeypatch.setattr(
        backend,
        "update_graph_params",
        lambda params_id, md: seen.append((params_id, md.num_reqs)) or update(params_id, md),
    )
    assert _greedy(llm, PROMPTS) == _greedy(eager_llm, PROMPTS)
    # One refresh per full replay, each with the params id its graph was captured with.
    assert len(seen) == graph_runner.mode_counts[("decode", "FULL")]
    for params_id, num_reqs in seen:
        padded = graph_runner.dispatcher.dispatch(BatchDescriptor(num_reqs, num_reqs, True))[1]
        assert params_id == graph_runner.graph_params[padded]


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"])
def test_padded_rows_write_no_kv(stories_dir: Path, mode: str) -> None:
    llm = _llm(stories_dir, mode, [1, 2, 4, 8])
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    counts = runner.graph_runner.mode_counts
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()  # the prefill: 10 tokens, above the largest size, runs eager
    before = [t.clone() for pair in runner.attn_backend.kv_caches for t in pair]
    counts_before = dict(counts)
    engine.step()  # decode of 3, padded to 4
    ran = {k: v - counts_before.get(k, 0) for k, v in counts.items() if v != counts_before.get(k)}
    assert sum(ran.values()) == 1 and next(iter(ran))[1] != "NONE", ran
    written = sorted(runner.buffers.slot_mapping.np[:3].tolist())
    assert runner.buffers.slot_mapping.np[3] == -1  # the padded row
    after = [t for pair in runner.attn_backend.kv_caches for t in pair]
    for old, new in zip(before, after, strict=True):
        slots = changed_slots(old, new)
        # The reserved null block 0 aside, exactly the three real rows' slots changed.
        assert [s for s in slots if s >= runner.block_size] == written


def _tensor_addresses(obj: object) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


def test_workspaces_and_kv_caches_keep_their_addresses_through_replays(
    stories_dir: Path,
) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4, 8])
    backend = llm.llm_engine.runner.attn_backend
    workspaces = _tensor_addresses(backend)
    assert workspaces, "no workspace allocated before capture"
    caches = [t.data_ptr() for pair in backend.kv_caches for t in pair]
    # Eight requests decoding up to max_model_len: the largest workspace use.
    params = greedy(100)
    llm.generate([[1, 20 + i] * 10 for i in range(8)], params, use_tqdm=False)
    assert llm.llm_engine.runner.graph_runner.mode_counts[("decode", "FULL")] > 0
    assert _tensor_addresses(backend) == workspaces
    assert [t.data_ptr() for pair in backend.kv_caches for t in pair] == caches


def test_a_graph_checked_against_other_tensors_raises(stories_dir: Path) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2])
    graph_runner = llm.llm_engine.runner.graph_runner
    (mode, key), graph = next(iter(graph_runner.graphs.items()))
    inputs = graph_runner.graph_inputs(mode, key)
    graph.check_inputs(inputs)
    with pytest.raises(InputAddressError):
        graph.check_inputs([t.clone() for t in inputs])


def test_a_reallocated_persistent_buffer_is_caught_on_first_replay(stories_dir: Path) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2])
    buffers = llm.llm_engine.runner.buffers
    buffers.input_ids = PersistentBuffer(
        (buffers.max_num_tokens,), torch.int64, torch.device("cpu"), 0
    )
    with pytest.raises(InputAddressError):
        _greedy(llm, PROMPTS[:1])


# ---------------------------------------------------------------- dynamic decode graph


def test_the_dynamic_decode_graph_serves_batches_above_the_sizes_with_eager_ids(
    stories_dir: Path, eager_llm: LLM
) -> None:
    """Sizes [1, 2, 4], max_num_seqs 8: one graph of 5 to 8 rows, traced with symbolic rows
    once, replayed at each batch size the requests leave (8 down to 5), every step FULL;
    ids as the eager engine's. A replay outside its rows is refused."""
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4], dynamic=True)
    graph_runner = llm.llm_engine.runner.graph_runner
    assert graph_runner.stats.dynamic_decode_rows == (5, 8)
    assert graph_runner.stats.num_graphs == 4
    graph = graph_runner.graphs[(RuntimeMode.FULL, graph_runner.dynamic_key)]
    assert graph.name == "FULL(rows 5-8)"
    # One symbol for the rows in the traced code, no size of 5 to 8 baked in.
    assert [n.op for n in graph.graph_module.graph.nodes].count("placeholder") >= 2
    prompts = [[1, 20 + i, 30 + i] for i in range(8)]
    # Different lengths: the batch shrinks from 8 to 5 as requests finish.
    params = [greedy(6 + 3 * i) for i in range(8)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    counts = graph_runner.mode_counts
    assert counts[("decode", "FULL")] > 0 and counts[("decode", "NONE")] == 0
    assert graph.num_replays > 0
    with pytest.raises(ValueError, match="rows"):
        graph.replay_rows(4)


def test_a_dynamic_decode_graph_that_cannot_be_traced_leaves_those_batches_eager(
    stories_dir: Path,
    eager_llm: LLM,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model whose trace depends on the row count fails the trace (trace_rows): start-up
    goes on without the graph, logs why once, and the engine's dispatcher no longer sends
    those batches to a graph."""
    from decodegraph.platforms.cpu import CpuPlatform

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the trace guarded on the row count")

    monkeypatch.setattr(CpuPlatform, "make_dynamic_graph", fail)
    with caplog.at_level("WARNING", logger="decodegraph.graphs.graph_runner"):
        llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4], dynamic=True)
    assert "no dynamic decode graph for 5-8 requests" in caplog.text
    assert "guarded on the row count" in caplog.text
    graph_runner = llm.llm_engine.runner.graph_runner
    assert graph_runner.stats.dynamic_decode_rows is None and graph_runner.stats.num_graphs == 3
    assert llm.llm_engine.engine_core.dispatcher.dynamic_decode_rows is None
    prompts = [[1, 20 + i, 30 + i] for i in range(8)]
    assert _greedy(llm, prompts) == _greedy(eager_llm, prompts)
    assert graph_runner.mode_counts[("decode", "NONE")] > 0


def test_a_dynamic_decode_graph_asked_of_a_platform_without_one_is_refused_with_a_warning(
    stories_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        registered_platform(StaticGraphPlatform) as device,
        caplog.at_level("WARNING", logger="decodegraph.graphs.graph_runner"),
    ):
        llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4], dynamic=True, device=device)
    assert "compilation_config.dynamic_decode_graph" in caplog.text
    assert llm.llm_engine.runner.graph_runner.dynamic_key is None


# ------------------------------------------------ the dynamic decode graph, in the background


def _default_llm(stories_dir: Path, use_inductor: bool = True) -> LLM:
    """Sizes [1, 2, 4], max_num_seqs 8, dynamic_decode_graph left unset (the default)."""
    return LLM(
        str(stories_dir),
        compilation_config={
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": [1, 2, 4],
            "use_inductor": use_inductor,
        },
        max_model_len=128,
        max_num_seqs=8,
    )


def test_unset_the_dynamic_decode_graph_is_made_in_the_background_once_a_batch_needs_it(
    stories_dir: Path, eager_llm: LLM
) -> None:
    """Nothing at start-up; the first batch of 5 to 8 requests sets it building on a thread
    of its own while the steps go on eagerly; once made, the dispatcher sends those
    batches to it. Ids equal the eager engine's before, during and after."""
    llm = _default_llm(stories_dir)
    core = llm.llm_engine.engine_core
    graph_runner = llm.llm_engine.runner.graph_runner
    stats = graph_runner.stats
    assert stats.dynamic_decode_build == "not needed yet" and stats.num_graphs == 3
    assert core.dispatcher.dynamic_decode_rows is None
    assert graph_runner.dispatcher.dynamic_decode_rows is None
    assert _greedy(llm, PROMPTS) == _greedy(eager_llm, PROMPTS)  # 3 requests: no need
    assert stats.dynamic_decode_build == "not needed yet"

    prompts = [[1, 20 + i, 30 + i] for i in range(8)]
    params = [greedy(6 + 3 * i) for i in range(8)]
    want = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert stats.dynamic_decode_build in ("building", "ready")
    assert graph_runner.mode_counts[("decode", "NONE")] > 0  # eager until it was made
    core.wait_for_background_graph()
    assert stats.dynamic_decode_build == "ready" and stats.dynamic_decode_build_seconds > 0
    assert core.dispatcher.dynamic_decode_rows == stats.dynamic_decode_rows == (5, 8)
    assert stats.num_graphs == 4

    eager_steps = graph_runner.mode_counts[("decode", "NONE")]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graph_runner.mode_counts[("decode", "NONE")] == eager_steps
    graph = graph_runner.graphs[(RuntimeMode.FULL, graph_runner.dynamic_key)]
    assert graph.name == "FULL(rows 5-8)" and graph.num_replays > 0


def test_the_engine_steps_while_the_dynamic_decode_graph_is_traced_and_compiled(
    stories_dir: Path, eager_llm: LLM
) -> None:
    """While make_fx traces, torch.nn.Module.__call__ is patched for the whole process: a
    step waits for the trace (platforms/base.py: module_call_lock), then runs eagerly
    beside the compile, with eager ids."""
    llm = _default_llm(stories_dir)
    graph_runner = llm.llm_engine.runner.graph_runner
    prompts = [[1, 40 + i, 50 + i] for i in range(8)]
    want = _greedy(eager_llm, prompts)
    graph_runner.dispatch(8, 8, True)  # the build starts now, and steps follow at once
    build = graph_runner._background[graph_runner.dynamic_key]
    assert build.thread is not None
    rounds = 0
    while build.thread.is_alive() and rounds < 100:
        assert _greedy(llm, prompts) == want
        rounds += 1
    assert rounds > 0
    llm.llm_engine.engine_core.wait_for_background_graph()
    assert graph_runner.stats.dynamic_decode_build == "ready"
    assert _greedy(llm, prompts) == want


def test_inductors_own_fx_trace_is_made_on_the_stepping_thread_before_a_build(
    stories_dir: Path,
) -> None:
    """Inductor's first lowering in a process traces a one-node module with torch.fx's own
    tracer, which patches torch.nn.Module.__call__ for the whole process: a step beside it
    would call its modules through that tracer. The engine's thread makes it first."""
    from torch._inductor.loop_body import InterpreterShim

    llm = _default_llm(stories_dir, use_inductor=False)
    graph_runner = llm.llm_engine.runner.graph_runner
    InterpreterShim._dummy_gm.cache_clear()
    graph_runner.dispatch(8, 8, True)
    assert InterpreterShim._dummy_gm.cache_info().currsize == 1
    graph_runner.close()


def test_the_background_build_writes_nothing_the_steps_use(stories_dir: Path) -> None:
    """The thread traces and compiles only (a module from the compiled-graph index
    included): the buffers a step wrote and the KV caches are as they were until the
    engine's thread finishes the graph between steps."""
    llm = _default_llm(stories_dir)
    runner = llm.llm_engine.runner
    graph_runner, buffers = runner.graph_runner, runner.buffers
    buffers.input_ids.np[:] = 7
    buffers.positions.np[:] = 3
    slots = buffers.kv_groups[0].slot_mapping.np
    slots[:] = np.arange(16, 16 + len(slots))  # live slots of block 1 on
    before = [t.clone() for t in (buffers.input_ids.gpu, buffers.positions.gpu)]
    caches = [t.clone() for pair in runner.attn_backend.kv_caches for t in pair]
    graph_runner.dispatch(6, 6, True)  # a batch for the dynamic graph: the build starts
    build = graph_runner._background[graph_runner.dynamic_key]
    assert build.thread is not None
    build.thread.join()
    assert build.error is None and build.graph is not None
    assert torch.equal(buffers.input_ids.gpu, before[0])
    assert torch.equal(buffers.positions.gpu, before[1])
    assert (slots == np.arange(16, 16 + len(slots))).all()
    after = [t for pair in runner.attn_backend.kv_caches for t in pair]
    assert all(torch.equal(a, b) for a, b in zip(after, caches, strict=True))
    assert graph_runner.finish_background_build(runner._prepare_dummy) == [graph_runner.dynamic_key]
    assert graph_runner.dispatcher.dynamic_decode_rows == (5, 8)


@pytest.mark.parametrize("use_inductor", [False, True])
def test_a_background_build_that_fails_leaves_those_batches_eager(
    stories_dir: Path,
    eager_llm: LLM,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    use_inductor: bool,
) -> None:
    """Said once (with Inductor, the trace that looks in the caches before a forked
    compile is the one that fails: nothing is tried again)."""
    from decodegraph.platforms.cpu import CpuPlatform

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the trace guarded on the row count")

    monkeypatch.setattr(CpuPlatform, "make_dynamic_graph", fail)
    llm = _default_llm(stories_dir, use_inductor=use_inductor)
    prompts = [[1, 20 + i, 30 + i] for i in range(8)]
    with caplog.at_level("WARNING", logger="decodegraph.graphs.graph_runner"):
        assert _greedy(llm, prompts) == _greedy(eager_llm, prompts)
        llm.llm_engine.engine_core.wait_for_background_graph()
    assert caplog.text.count("no dynamic decode graph for 5-8 requests") == 1
    assert "guarded on the row count" in caplog.text
    stats = llm.llm_engine.runner.graph_runner.stats
    assert stats.dynamic_decode_build == "failed" and stats.dynamic_decode_rows is None
    assert llm.llm_engine.engine_core.dispatcher.dynamic_decode_rows is None
    assert _greedy(llm, prompts) == _greedy(eager_llm, prompts)


def test_closing_the_runner_stops_a_background_build(stories_dir: Path) -> None:
    llm = _default_llm(stories_dir, use_inductor=False)
    graph_runner = llm.llm_engine.runner.graph_runner
    graph_runner.dispatch(8, 8, True)
    build = graph_runner._background[graph_runner.dynamic_key]
    assert build.thread is not None
    graph_runner.close()
    assert not build.thread.is_alive() and build.cancelled
    assert graph_runner._background == {}
    assert graph_runner.finish_background_build(llm.llm_engine.runner._prepare_dummy) == []
    assert graph_runner.dispatcher.dynamic_decode_rows is None


# ---------------------------------------------------------------- decode sizes on demand


def _on_demand_llm(stories_dir: Path, **compilation: object) -> LLM:
    """FULL_DECODE_ONLY at max_num_seqs 8 (no dynamic decode graph: no rows above 8)."""
    return LLM(
        str(stories_dir),
        compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", **compilation},
        max_model_len=128,
        max_num_seqs=8,
    )


def test_unset_the_default_sizes_above_one_are_made_when_a_batch_first_needs_them(
    stories_dir: Path, eager_llm: LLM
) -> None:
    """Start-up makes the 1-request graph only; a batch of 2-4 requests sets the 4-request
    graph building (eager meanwhile), 5-8 the 8-request one; each serves from the step
    after it is made, in both dispatchers. Ids equal the eager engine's throughout."""
    llm = _on_demand_llm(stories_dir)
    core = llm.llm_engine.engine_core
    graph_runner = llm.llm_engine.runner.graph_runner
    stats = graph_runner.stats
    assert graph_runner.capture_sizes == [1, 4, 8] and graph_runner.on_demand_sizes == [4, 8]
    assert stats.num_graphs == 1
    assert stats.on_demand_builds == {4: "not needed yet", 8: "not needed yet"}
    assert core.dispatcher.made_decode_sizes == graph_runner.dispatcher.made_decode_sizes == [1]

    assert _greedy(llm, PROMPTS) == _greedy(eager_llm, PROMPTS)  # 3, 2, then 1 request
    assert stats.on_demand_builds[4] in ("building", "ready")
    assert stats.on_demand_builds[8] == "not needed yet"
    core.wait_for_background_graph()
    assert stats.on_demand_builds[4] == "ready" and stats.num_graphs == 2
    assert core.dispatcher.made_decode_sizes == graph_runner.dispatcher.made_decode_sizes == [1, 4]
    eager_steps = graph_runner.mode_counts[("decode", "NONE")]
    assert _greedy(llm, PROMPTS) == _greedy(eager_llm, PROMPTS)
    assert graph_runner.mode_counts[("decode", "NONE")] == eager_steps  # all on graphs now
    assert graph_runner.graphs[(RuntimeMode.FULL, BatchDescriptor(4, 4, True))].num_replays > 0

    prompts = [[1, 20 + i, 30 + i] for i in range(8)]
    assert _greedy(llm, prompts) == _greedy(eager_llm, prompts)
    core.wait_for_background_graph()
    assert stats.on_demand_builds == {4: "ready", 8: "ready"} and stats.num_graphs == 3
    assert core.dispatcher.made_decode_sizes == [1, 4, 8]
    eager_steps = graph_runner.mode_counts[("decode", "NONE")]
    assert _greedy(llm, prompts) == _greedy(eager_llm, prompts)
    assert graph_runner.mode_counts[("decode", "NONE")] == eager_steps


def test_a_size_asked_for_in_a_batch_serves_that_batch_while_it_steps_back_to_back(
    stories_dir: Path, eager_llm: LLM
) -> None:
    """The build's trace waits for the lock every step holds (platforms/base.py:
    module_call_lock); that lock goes to it at the next step's start, so the graph is
    made and serves the batch that asked for it, not only the batches after it."""
    llm = _on_demand_llm(stories_dir, use_inductor=False)
    graph_runner = llm.llm_engine.runner.graph_runner
    prompts = [[1, 20 + i, 30 + i] for i in range(4)]
    params = [greedy(120) for _ in prompts]
    want = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graph_runner.stats.on_demand_builds[4] == "ready"
    assert (
        graph_runner.mode_counts[("decode", "FULL")] > graph_runner.mode_counts[("decode", "NONE")]
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("forked", [True, False])
def test_a_size_made_on_demand_is_compiled_in_a_forked_child_and_loaded_here(
    stories_dir: Path,
    eager_llm: LLM,
    forked: bool,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """From a cold Inductor cache: the child compiles and enters the module in the
    index, and this process only loads it (Inductor compiles nothing here); with
    DECODEGRAPH_FORKED_GRAPH_BUILDS=0 the build thread compiles it. From a warm one
    nothing is forked. Ids equal the eager engine's throughout (graphs/forked_build.py)."""
    from decodegraph.graphs.forked_build import FORKED_BUILDS_ENV

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv(FORKED_BUILDS_ENV, "1" if forked else "0")
    llm = _on_demand_llm(stories_dir)
    graph_runner = llm.llm_engine.runner.graph_runner
    build = graph_runner._background[BatchDescriptor(4, 4, True)]
    compiles = count_compiles(monkeypatch)
    prompts = [[1, 20 + i, 30 + i] for i in range(4)]
    params = [greedy(24) for _ in prompts]
    want = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    llm.llm_engine.engine_core.wait_for_background_graph()
    assert graph_runner.stats.on_demand_builds[4] == "ready"
    assert build.forked is forked and build.error is None
    assert len(compiles) == (0 if forked else 1)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graph_runner.graphs[(RuntimeMode.FULL, BatchDescriptor(4, 4, True))].num_replays > 0

    # Another engine on that cache: the module is in the index, so nothing is forked.
    again = _on_demand_llm(stories_dir)
    build = again.llm_engine.runner.graph_runner._background[BatchDescriptor(4, 4, True)]
    assert [o.outputs[0].token_ids for o in again.generate(prompts, params, use_tqdm=False)] == want
    again.llm_engine.engine_core.wait_for_background_graph()
    assert build.graph is not None and not build.forked
    assert len(compiles) == (0 if forked else 1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_closing_the_runner_stops_a_forked_build_without_compiling_here(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    llm = _on_demand_llm(stories_dir)
    graph_runner = llm.llm_engine.runner.graph_runner
    compiles = count_compiles(monkeypatch)
    graph_runner.dispatch(3, 3, True)  # the 4-request graph's build starts
    build = graph_runner._background[BatchDescriptor(4, 4, True)]
    assert build.thread is not None
    graph_runner.close()
    assert not build.thread.is_alive() and build.cancelled
    assert build.graph is None and compiles == []


def test_a_batch_pads_to_a_larger_made_size_while_its_own_is_not_made(
    stories_dir: Path, eager_llm: LLM
) -> None:
    llm = _on_demand_llm(stories_dir)
    core = llm.llm_engine.engine_core
    graph_runner = llm.llm_engine.runner.graph_runner
    prompts = [[1, 20 + i, 30 + i] for i in range(8)]
    assert _greedy(llm, prompts) == _greedy(eager_llm, prompts)  # 8 requests: size 8
    core.wait_for_background_graph()
    assert graph_runner.stats.on_demand_builds == {4: "not needed yet", 8: "ready"}
    full_8 = graph_runner.graphs[(RuntimeMode.FULL, BatchDescriptor(8, 8, True))]
    replays = full_8.num_replays
    assert _greedy(llm, PROMPTS) == _greedy(eager_llm, PROMPTS)  # 3 requests: size 4 builds
    assert full_8.num_replays > replays  # the 8-request graph served them meanwhile
    assert graph_runner.stats.on_demand_builds[4] in ("building", "ready")


def test_a_decode_size_made_on_demand_writes_nothing_the_steps_use(stories_dir: Path) -> None:
    """Its trace runs on fakes and its compile runs nothing (a module from the index
    included): the buffers a step wrote and the KV caches are as they were until the
    engine's thread finishes the graph between steps."""
    llm = _on_demand_llm(stories_dir)
    runner = llm.llm_engine.runner
    graph_runner, buffers = runner.graph_runner, runner.buffers
    buffers.input_ids.np[:] = 7
    buffers.positions.np[:] = 3
    slots = buffers.kv_groups[0].slot_mapping.np
    slots[:] = np.arange(16, 16 + len(slots))  # live slots of block 1 on
    before = [t.clone() for t in (buffers.input_ids.gpu, buffers.positions.gpu)]
    caches = [t.clone() for pair in runner.attn_backend.kv_caches for t in pair]
    graph_runner.dispatch(3, 3, True)  # a batch for the 4-request graph: its build starts
    build = graph_runner._background[BatchDescriptor(4, 4, True)]
    assert build.thread is not None
    build.thread.join()
    assert build.error is None and build.graph is not None
    assert torch.equal(buffers.input_ids.gpu, before[0])
    assert torch.equal(buffers.positions.gpu, before[1])
    assert (slots == np.arange(16, 16 + len(slots))).all()
    after = [t for pair in runner.attn_backend.kv_caches for t in pair]
    assert all(torch.equal(a, b) for a, b in zip(after, caches, strict=True))
    assert graph_runner.finish_background_build(runner._prepare_dummy) == [
        BatchDescriptor(4, 4, True)
    ]
    assert graph_runner.dispatcher.made_decode_sizes == [1, 4]


@pytest.mark.parametrize(
    ("compilation", "made_at_start"),
    [
        ({"cudagraph_capture_sizes": [1, 2, 4]}, [1, 2, 4]),  # listed: all at start-up
        ({"cudagraph_capture_sizes": [1, 2, 4], "decode_graphs_on_demand": True}, [1]),
        ({"decode_graphs_on_demand": False}, [1, 4, 8]),
        ({"cudagraph_mode": "PIECEWISE"}, [1, 4, 8]),  # no full decode graphs to defer
    ],
)
def test_which_sizes_start_up_makes(
    stories_dir: Path, compilation: dict, made_at_start: list[int]
) -> None:
    llm = _on_demand_llm(stories_dir, use_inductor=False, **compilation)
    assert llm.llm_engine.engine_core.dispatcher.made_decode_sizes == made_at_start
    graph_runner = llm.llm_engine.runner.graph_runner
    assert graph_runner.dispatcher.made_decode_sizes == made_at_start
    assert graph_runner.on_demand_sizes == [
        s for s in graph_runner.capture_sizes if s not in made_at_start
    ]


def test_on_demand_under_tensor_parallelism_is_refused_with_the_reason(
    stories_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rank would have to switch in the same step: a rank of two makes every size at
    start-up, and `true` says why."""
    runner = _on_demand_llm(stories_dir, use_inductor=False).llm_engine.runner
    one = runner.graph_runner

    def rank_of_two(on_demand: bool | None) -> GraphRunner:
        config = runner.config
        config.compilation_config.decode_graphs_on_demand = on_demand
        return GraphRunner(
            config, one.platform, one.buffers, one.attn_groups, one._eager_context, 0, 2
        )

    unset = rank_of_two(None)
    unset.resolve()
    assert unset.on_demand_sizes == [] and unset.dispatcher.made_decode_sizes == [1, 4, 8]
    with caplog.at_level("WARNING", logger="decodegraph.graphs.graph_runner"):
        rank_of_two(True).resolve()
    assert "decode_graphs_on_demand: under tensor parallelism" in caplog.text


def test_unset_under_tensor_parallelism_there_is_no_dynamic_decode_graph(
    stories_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rank would have to switch to it in the same step: unset, a rank of two makes
    none (true still makes it at start-up)."""
    runner = _default_llm(stories_dir, use_inductor=False).llm_engine.runner
    one = runner.graph_runner

    def rank_of_two(dynamic: bool | None) -> GraphRunner:
        config = runner.config
        config.compilation_config.dynamic_decode_graph = dynamic
        return GraphRunner(
            config, one.platform, one.buffers, one.attn_groups, one._eager_context, 0, 2
        )

    with caplog.at_level("INFO", logger="decodegraph.graphs.graph_runner"):
        unset = rank_of_two(None)
        unset.resolve()
    assert unset.dynamic_key is None and "under tensor parallelism" in caplog.text
    asked = rank_of_two(True)
    asked.resolve()
    assert asked.dynamic_rows == (5, 8) and not asked.dynamic_in_background
    assert asked.dispatcher.dynamic_decode_rows == (5, 8)
