"""CPU graphs: traced op graphs bound to their inputs, replayed without the Python."""

from __future__ import annotations

import pytest
import torch

from decodegraph.platforms.base import InputAddressError
from decodegraph.platforms.cpu import CpuPlatform
from decodegraph.platforms.cpu_graph import CpuGraph
from tests.utils.inductor import count_compiles


def _affine(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) + 1


def test_a_replay_reads_the_bound_inputs_new_values() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph = CpuGraph("g", _affine, [x, w], use_inductor=False)
    x.copy_(torch.randn(4, 8))  # in place: same address, new values
    torch.testing.assert_close(graph.replay(), _affine(x, w))
    assert graph.num_replays == 1


def test_a_replay_does_not_see_a_tensor_that_replaced_an_input() -> None:
    """Device-graph semantics: new values must be written into the bound tensor."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph = CpuGraph("g", _affine, [x, w], use_inductor=False)
    before = graph.replay().clone()
    x = torch.randn(4, 8)  # a new tensor: the graph still reads the old one
    torch.testing.assert_close(graph.replay(), before)


def test_replay_runs_none_of_the_python_and_keeps_baked_host_values() -> None:
    calls, scale = [], [2.0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * scale[0]  # a host value, baked at capture like a device graph does

    x = torch.ones(3)
    graph = CpuGraph("g", fn, [x], use_inductor=False)
    traced_calls = len(calls)
    scale[0] = 5.0
    out = graph.replay()
    assert len(calls) == traced_calls, "replay ran the captured function's Python"
    torch.testing.assert_close(out, torch.full((3,), 2.0))


def test_check_inputs_names_an_input_at_another_address() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph = CpuGraph("decode(4)", _affine, [x, w], use_inductor=False)
    graph.check_inputs([x, w])
    with pytest.raises(InputAddressError, match=r"decode\(4\).*\[1\]"):
        graph.check_inputs([x, w.clone()])


def test_check_inputs_catches_a_view_of_another_shape_at_the_same_address() -> None:
    buf, w = torch.randn(8, 8), torch.randn(8, 8)
    graph = CpuGraph("g", _affine, [buf[:4], w], use_inductor=False)
    with pytest.raises(InputAddressError, match=r"inputs \[0\] do not have their capture"):
        graph.check_inputs([buf[:6], w])


def test_check_inputs_catches_a_view_at_another_offset() -> None:
    buf, w = torch.randn(16, 8), torch.randn(8, 8)
    graph = CpuGraph("g", _affine, [buf[:4], w], use_inductor=False)
    with pytest.raises(InputAddressError):
        graph.check_inputs([buf[4:8], w])
    with pytest.raises(InputAddressError, match="3 inputs given, 2 captured"):
        graph.check_inputs([buf[:4], w, w])


class _Tied(torch.nn.Module):
    """One weight read twice (like tied embeddings) beside a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.register_buffer("b", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w + self.b) @ self.w.t()


def test_an_inductor_graph_reads_the_weights_themselves_and_is_called_directly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torch._inductor.utils import fresh_cache

    model, x = _Tied(), torch.randn(4, 8)
    with fresh_cache(), caplog.at_level("DEBUG", logger="decodegraph.platforms.cpu_graph"):
        graph = CpuGraph("g", model, [x], use_inductor=True)
    assert "calling Inductor's function directly" in caplog.text
    x.copy_(torch.randn(4, 8))
    torch.testing.assert_close(graph.replay(), model(x))
    model.w.mul_(2)  # a weight changed in place is read at replay, not baked in
    torch.testing.assert_close(graph.replay(), model(x))


def test_an_inductor_argmax_picks_the_first_maximum_like_the_sampler() -> None:
    """Full decode graphs return argmax ids that stand in for the sampler's greedy()."""
    from decodegraph.sample.sampler import greedy

    logits = torch.randint(0, 4, (6, 40)).float()  # many tied maxima per row
    graph = CpuGraph("g", lambda x: (x * 1, x.argmax(dim=-1)), [logits], use_inductor=True)
    _, ids = graph.replay()
    assert torch.equal(ids, greedy(logits))


def test_a_graph_compiled_again_is_loaded_from_inductors_cache_not_regenerated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second engine (here: a second compile of the same trace over new tensors of the
    same shapes) loads the graph from the FX graph cache instead of lowering it again."""
    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import fresh_cache

    lowerings: list[int] = []
    compile_to_module = GraphLowering.compile_to_module

    def counted(self: GraphLowering) -> object:
        lowerings.append(1)
        return compile_to_module(self)

    monkeypatch.setattr(GraphLowering, "compile_to_module", counted)
    with fresh_cache():
        first = CpuGraph("g", _affine, [torch.randn(4, 8), torch.randn(8, 8)], True)
        x, w = torch.randn(4, 8), torch.randn(8, 8)
        second = CpuGraph("g", _affine, [x, w], True)
    assert len(lowerings) == 1
    torch.testing.assert_close(second.replay(), _affine(x, w))
    assert first.replay().shape == (4, 8)


def test_a_graph_traced_again_loads_its_module_without_compiling(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A later engine whose trace is the same graph skips AOTAutograd and Inductor
    altogether: the compiled-graph index names the module the first compile wrote."""
    from torch._inductor.utils import fresh_cache

    compiles = count_compiles(monkeypatch)
    with fresh_cache():
        CpuGraph("g", _affine, [torch.randn(4, 8), torch.randn(8, 8)], True)
        x, w = torch.randn(4, 8), torch.randn(8, 8)
        with caplog.at_level("DEBUG", logger="decodegraph.platforms.cpu_graph"):
            second = CpuGraph("g", _affine, [x, w], True)
    assert len(compiles) == 1
    assert "Inductor's module from an earlier compile" in caplog.text
    torch.testing.assert_close(second.replay(), _affine(x, w))
    x.copy_(torch.randn(4, 8))  # bound inputs, read at every replay
    torch.testing.assert_close(second.replay(), _affine(x, w))


def test_another_shape_or_another_graph_is_compiled_not_taken_from_the_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch._inductor.utils import fresh_cache

    compiles = count_compiles(monkeypatch)
    with fresh_cache():
        CpuGraph("g", _affine, [torch.randn(4, 8), torch.randn(8, 8)], True)
        x, w = torch.randn(2, 8), torch.randn(8, 8)
        smaller = CpuGraph("g", _affine, [x, w], True)
        other = CpuGraph("g", lambda x, w: torch.relu(x @ w) + 2, [x, w], True)
    assert len(compiles) == 3
    torch.testing.assert_close(smaller.replay(), _affine(x, w))
    torch.testing.assert_close(other.replay(), torch.relu(x @ w) + 2)


def test_an_index_entry_whose_module_is_gone_compiles_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.utils import fresh_cache

    compiles = count_compiles(monkeypatch)
    with fresh_cache():
        CpuGraph("g", _affine, [torch.randn(4, 8), torch.randn(8, 8)], True)
        PyCodeCache.cache_clear(purge=True)  # deletes the modules' files too
        x, w = torch.randn(4, 8), torch.randn(8, 8)
        again = CpuGraph("g", _affine, [x, w], True)
    assert len(compiles) == 2
    torch.testing.assert_close(again.replay(), _affine(x, w))


def test_the_first_compile_waits_for_the_early_vector_isa_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compile needs the probe's answer: it waits for the probe, not probes beside it."""
    import threading
    import time

    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    from decodegraph.platforms import cpu_graph

    done = threading.Event()
    pick = cpu_vec_isa.pick_vec_isa

    def slow_pick() -> object:
        time.sleep(0.3)
        done.set()
        # Inductor's own answer: a compile that misses the cache (the first of this
        # graph in a process and cache) builds with what the pick gives.
        return pick()

    seen: list[bool] = []
    node_metadata = cpu_graph.cpu_graph_cache.node_metadata

    def recording(gm: torch.fx.GraphModule) -> list[object]:
        seen.append(done.is_set())
        return node_metadata(gm)

    monkeypatch.setattr(cpu_graph, "_isa_probe", None)
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", slow_pick)
    monkeypatch.setattr(cpu_graph.cpu_graph_cache, "node_metadata", recording)
    cpu_graph.start_vector_isa_probe(True)
    cpu_graph.start_vector_isa_probe(True)  # once per process
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph = CpuGraph("g", _affine, [x, w], use_inductor=True)
    assert seen == [True]
    torch.testing.assert_close(graph.replay(), _affine(x, w))


def test_the_probe_checks_each_candidate_isa_in_a_thread_under_the_compiles_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every ISA whose features the CPU reports is checked side by side, each under the
    `cpp.vec_isa_ok` the compiles use (Inductor's config patches are per thread), before
    the pick, which then finds the answers made."""
    import threading

    import torch._inductor.config as inductor_config
    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    from decodegraph.platforms import cpu_graph

    checked: list[tuple[str, str, object]] = []
    both_running = threading.Barrier(2, timeout=10)

    class FakeIsa:
        def __init__(self, name: str) -> None:
            self.name = name

        def __str__(self) -> str:
            return self.name

        def __bool__(self) -> bool:
            ok = inductor_config.cpp.vec_isa_ok
            checked.append((self.name, threading.current_thread().name, ok))
            both_running.wait()  # the two checks overlap, or this times out
            return True

    picked: list[list[str]] = []
    isas = [FakeIsa("avx512 avx512_vnni"), FakeIsa("avx512"), FakeIsa("amx_tile")]
    monkeypatch.setattr(cpu_graph, "_isa_probe", None)
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", isas)
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx512", "avx512_vnni"])
    monkeypatch.setattr(
        cpu_vec_isa, "pick_vec_isa", lambda: picked.append([name for name, *_ in checked])
    )
    cpu_graph.start_vector_isa_probe(True)
    cpu_graph._wait_for_isa_probe()
    assert sorted(checked) == [
        ("avx512", "decodegraph-isa-check", True),
        ("avx512 avx512_vnni", "decodegraph-isa-check", True),
    ]
    assert len(picked) == 1 and sorted(picked[0]) == ["avx512", "avx512 avx512_vnni"]


@pytest.mark.parametrize(("mode", "starts"), [("NONE", False), ("FULL_DECODE_ONLY", True)])
def test_start_up_probes_the_vector_isa_early_only_where_graphs_are_compiled(
    monkeypatch: pytest.MonkeyPatch, mode: str, starts: bool
) -> None:
    from decodegraph.entrypoints.llm import LLM
    from decodegraph.platforms.cpu import CpuPlatform

    calls: list[object] = []
    monkeypatch.setattr(CpuPlatform, "prepare_graph_compile", lambda self, cc: calls.append(cc))
    llm = LLM(
        "stories260K",
        max_num_seqs=1,
        compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1]},
    )
    assert bool(calls) is starts
    del llm


def test_the_graph_index_key_changes_with_the_thread_count() -> None:
    """Inductor writes the intra-op thread count into its kernels' parallel loops."""
    from decodegraph.platforms import cpu_graph_cache
    from decodegraph.platforms.base import trace

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm = trace(_affine, [x, w])
    meta = cpu_graph_cache.node_metadata(gm)
    threads = torch.get_num_threads()
    try:
        keys = set()
        for n in (1, 2):
            torch.set_num_threads(n)
            keys.add(cpu_graph_cache.graph_key(gm, meta, [x, w], {}))
    finally:
        torch.set_num_threads(threads)
    assert len(keys) == 2


def test_a_cached_module_that_fails_is_a_miss_not_a_failed_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from decodegraph.platforms import cpu_graph

    def broken(args: list) -> list:
        raise RuntimeError("stale module")

    entry = cpu_graph.cpu_graph_cache.Entry(broken, bind_checked=True)
    monkeypatch.setattr(cpu_graph.cpu_graph_cache, "load", lambda key, options: entry)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph = CpuGraph("g", _affine, [x, w], use_inductor=True)
    torch.testing.assert_close(graph.replay(), _affine(x, w))


@pytest.mark.parametrize("user", [{}, {"cpp.vec_isa_ok": None}, {"cpp.vec_isa_ok": False}])
def test_the_early_probe_runs_under_the_options_the_compiles_use(
    monkeypatch: pytest.MonkeyPatch, user: dict
) -> None:
    """The process keeps the probe's answer: it must be asked as the compiles would."""
    from decodegraph.config import CompilationConfig
    from decodegraph.platforms import cpu

    asked: list[object] = []
    monkeypatch.setattr(cpu, "start_vector_isa_probe", asked.append)
    config = CompilationConfig(inductor_compile_config=user)
    platform = cpu.CpuPlatform()
    platform.prepare_graph_compile(config)
    assert asked == [platform.inductor_options(config).get("cpp.vec_isa_ok")]
    if user:
        assert asked == [user["cpp.vec_isa_ok"]]


# The platform's options: its graphs are C++ wrapper modules, which `defer` is about.
_CPP_WRAPPER = CpuPlatform.default_inductor_options


def test_deferred_graphs_build_their_cpp_in_the_background_and_finish_on_demand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `defer`, the constructor returns once Inductor has written the code; the C++
    compiler runs for it on the build thread, and finish() (or a first replay) waits for
    it and runs the graph. Graphs made one after the other all come out right."""
    import threading

    from torch._inductor import cpp_builder
    from torch._inductor.utils import fresh_cache

    threads: list[str] = []
    run = cpp_builder.run_compile_cmd

    def recorded(cmd_line: str, cwd: str) -> None:
        if ".main.cpp" in cmd_line or ".optimized.cpp" in cmd_line:  # not the headers
            threads.append(threading.current_thread().name)
        run(cmd_line, cwd)

    monkeypatch.setattr(cpp_builder, "run_compile_cmd", recorded)
    sizes = (3, 5)
    inputs = {n: [torch.randn(n, 8), torch.randn(8, 8)] for n in sizes}
    with fresh_cache():
        graphs = {
            n: CpuGraph("g", _affine, inputs[n], True, _CPP_WRAPPER, defer=True) for n in sizes
        }
        graphs[sizes[0]].finish()
        torch.testing.assert_close(graphs[sizes[0]].replay(), _affine(*inputs[sizes[0]]))
        # Not finished by hand: the first replay waits for the build.
        torch.testing.assert_close(graphs[sizes[1]].replay(), _affine(*inputs[sizes[1]]))
    assert len(threads) == 2 * len(sizes)  # wrapper and kernels, each graph
    assert all(name.startswith("decodegraph-c++") for name in threads)


def test_a_wrapper_and_its_kernels_compile_at_the_same_time_then_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading
    import time

    from torch._inductor import cpp_builder
    from torch._inductor.utils import fresh_cache

    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    run = cpp_builder.run_compile_cmd

    def recorded(cmd_line: str, cwd: str) -> None:
        kind = next((k for k in (".main.cpp", ".optimized.cpp", ".main.o") if k in cmd_line), None)
        if kind is None:  # a header or the ISA probe
            run(cmd_line, cwd)
            return
        with lock:
            events.append(("start", kind))
        time.sleep(0.2)  # long enough for the other compile to start if it runs beside
        run(cmd_line, cwd)
        with lock:
            events.append(("end", kind))

    monkeypatch.setattr(cpp_builder, "run_compile_cmd", recorded)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with fresh_cache():
        graph = CpuGraph("g", _affine, [x, w], True, _CPP_WRAPPER)
    torch.testing.assert_close(graph.replay(), _affine(x, w))
    starts = {kind for event, kind in events[:2] if event == "start"}
    assert starts == {".main.cpp", ".optimized.cpp"}  # both began before either ended
    assert events[-2:] == [("start", ".main.o"), ("end", ".main.o")]  # the link, last


def test_a_graph_made_without_defer_is_built_and_run_before_the_constructor_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch._inductor.codecache import CppWrapperCodeCache
    from torch._inductor.utils import fresh_cache

    loads: list[int] = []
    load_async = CppWrapperCodeCache.load_async.__func__

    def counted(cls: type, *args: object, **kwargs: object) -> object:
        load = load_async(cls, *args, **kwargs)
        return lambda: loads.append(1) or load()

    monkeypatch.setattr(CppWrapperCodeCache, "load_async", classmethod(counted))
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with fresh_cache():
        graph = CpuGraph("g", _affine, [x, w], True, _CPP_WRAPPER)
        assert loads  # the library was loaded (built) inside the constructor
    torch.testing.assert_close(graph.replay(), _affine(x, w))


def test_a_cpp_wrapper_graph_is_called_through_its_entry_and_gives_the_modules_outputs() -> None:
    """The module's Python `call` (a tensor for every non-tensor input, a handle for
    each) is skipped: the graph hands its tensors' handles to the C++ entry at once."""
    import sys

    from torch._inductor.utils import fresh_cache

    from decodegraph.platforms import inductor_cpp

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with fresh_cache():
        graph = CpuGraph("g", _affine, [x, w], True, _CPP_WRAPPER)
        modules = [m for m in list(sys.modules.values()) if hasattr(m, "inductor_entry")]
    module = modules[-1]
    call = module.call
    direct = inductor_cpp.entry_call(call)
    assert direct is not call
    torch.testing.assert_close(direct([x, w])[0], call([x, w])[0])
    x.copy_(torch.randn(4, 8))
    codes: list[object] = []
    sys.setprofile(lambda frame, event, _: codes.append(frame.f_code) if event == "call" else None)
    try:
        out = graph.replay()
    finally:
        sys.setprofile(None)
    torch.testing.assert_close(out, _affine(x, w))
    assert not [c for c in codes if c.co_filename == module.__file__]  # no frame of the module


def _cpp_wrapper_graph(x: torch.Tensor, w: torch.Tensor) -> tuple[CpuGraph, object]:
    """A C++ wrapper graph of _affine over x and w, and its module."""
    import sys

    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        graph = CpuGraph("g", _affine, [x, w], True, _CPP_WRAPPER)
        modules = [m for m in list(sys.modules.values()) if hasattr(m, "inductor_entry")]
    return graph, modules[-1]


def test_a_replay_calls_the_entry_bound_to_its_inputs_and_makes_no_handle_from_python(
    cpu_ops: object,
) -> None:
    """A replay runs the module's C++ entry over aliases of its inputs made once: neither
    the module's pybind entry nor torch's handle-making from Python tensors runs, and the
    values written into the inputs since are the ones it reads."""
    import sys

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph, module = _cpp_wrapper_graph(x, w)
    torch.testing.assert_close(graph.replay(), _affine(x, w))
    builtins: list[object] = []
    sys.setprofile(lambda frame, event, arg: builtins.append(arg) if event == "c_call" else None)
    try:
        outs = []
        for _ in range(3):
            x.copy_(torch.randn(4, 8))
            w.mul_(-1)
            outs.append((graph.replay(), _affine(x, w)))
    finally:
        sys.setprofile(None)
    for got, want in outs:
        torch.testing.assert_close(got, want)
    names = {getattr(b, "__name__", "") for b in builtins}
    assert "unsafe_alloc_void_ptrs_from_tensors" not in names
    assert "inductor_entry_cpp" not in names  # the module's pybind entry


def test_a_bound_entry_gives_the_modules_outputs_and_frees_its_aliases_with_the_graph(
    cpu_ops: object,
) -> None:
    import gc
    import types

    from decodegraph.platforms import inductor_cpp

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph, module = _cpp_wrapper_graph(x, w)
    uses = torch._C._storage_Use_Count(w.untyped_storage()._cdata)
    bound = inductor_cpp.bind_entry(module.call, [x, w], 1)
    assert isinstance(bound, types.BuiltinFunctionType)  # a C method's call, not ctypes'
    assert torch._C._storage_Use_Count(w.untyped_storage()._cdata) == uses + 1  # its alias
    (out,) = bound()
    torch.testing.assert_close(out, module.call([x, w])[0])
    del bound
    gc.collect()
    assert torch._C._storage_Use_Count(w.untyped_storage()._cdata) == uses
    del graph
    gc.collect()
    assert torch._C._storage_Use_Count(w.untyped_storage()._cdata) < uses


def test_an_entry_bound_with_too_few_outputs_is_refused_not_overrun(cpu_ops: object) -> None:
    from decodegraph.platforms import inductor_cpp

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    _, module = _cpp_wrapper_graph(x, w)
    bound = inductor_cpp.bind_entry(module.call, [x, w], 0)
    with pytest.raises(RuntimeError, match="more outputs than it was bound with"):
        bound()


@pytest.mark.parametrize("bad", ["raises", "other outputs"])
def test_a_bound_entry_that_fails_its_check_leaves_the_plain_call(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from decodegraph.platforms import cpu_graph

    def broken(*args: object) -> object:
        def call() -> list:
            if bad == "raises":
                raise RuntimeError("boom")
            return [torch.zeros(4, 8)]

        return call

    monkeypatch.setattr(cpu_graph, "bind_entry", broken)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph, _ = _cpp_wrapper_graph(x, w)
    x.copy_(torch.randn(4, 8))
    torch.testing.assert_close(graph.replay(), _affine(x, w))


def _count_plain_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at every plain call of a compiled graph (not its bound
    entry, and not the compile's or the index load's own run)."""
    from decodegraph.platforms import cpu_graph

    calls: list[int] = []
    original = cpu_graph._FlatCall.__call__

    def counted(self: object, *xs: torch.Tensor) -> object:
        calls.append(1)
        return original(self, *xs)

    monkeypatch.setattr(cpu_graph._FlatCall, "__call__", counted)
    return calls


@pytest.mark.parametrize("defer", [False, True], ids=["at once", "deferred"])
def test_binding_checks_against_the_run_just_made_not_another_forward(
    defer: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The bound entry is checked against the outputs of the run the compile (or, for a
    module from the index, its load) has just made over the same inputs: no plain call
    of the graph at start-up, cold or warm, and replays still right. A module from the
    index is bound in the constructor, deferred or not, before anything else can write
    into its inputs."""
    from torch._inductor.utils import fresh_cache

    calls = _count_plain_calls(monkeypatch)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with fresh_cache():
        cold = CpuGraph("g", _affine, [x, w], True, _CPP_WRAPPER, defer=defer)
        cold.finish()
        with caplog.at_level("DEBUG", logger="decodegraph.platforms.cpu_graph"):
            warm = CpuGraph("g", _affine, [x, w], True, _CPP_WRAPPER, defer=defer)
        assert "Inductor's module from an earlier compile" in caplog.text
        assert warm._pending is None  # finished in the constructor
    assert calls == []
    x.copy_(torch.randn(4, 8))
    torch.testing.assert_close(cold.replay(), _affine(x, w))
    torch.testing.assert_close(warm.replay(), _affine(x, w))
    assert "calling it plainly" not in caplog.text


def test_a_module_whose_bound_entry_passed_its_check_binds_unchecked_in_a_later_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check of a bound entry (a forward of the bound entry beside the plain one)
    runs once per module: the index records it, and a warm start that loads the module
    binds it without running it, then replays right."""
    from torch._inductor.utils import fresh_cache

    from decodegraph.platforms import cpu_graph

    bound_runs: list[int] = []
    original = cpu_graph.bind_entry

    def counted(*args: object) -> object:
        bound = original(*args)
        if bound is None:
            return None

        def call() -> list:
            bound_runs.append(1)
            return bound()

        return call

    monkeypatch.setattr(cpu_graph, "bind_entry", counted)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with fresh_cache():
        CpuGraph("g", _affine, [x, w], True, _CPP_WRAPPER)
        assert bound_runs == [1]  # the check, at the cold compile
        warm = CpuGraph("g", _affine, [x, w], True, _CPP_WRAPPER)
    assert bound_runs == [1]
    x.copy_(torch.randn(4, 8))
    torch.testing.assert_close(warm.replay(), _affine(x, w))
    assert bound_runs == [1, 1]


def test_a_bind_over_other_inputs_checks_against_a_plain_call_of_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compile's last run is over its own inputs: a bind over other tensors calls
    the graph plainly once to check the bound entry, and reads those tensors."""
    from torch._inductor.utils import fresh_cache

    from decodegraph.platforms.base import trace
    from decodegraph.platforms.cpu_graph import start_inductor_compile

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with fresh_cache():
        compiled = start_inductor_compile(trace(_affine, [x, w]), [x, w], _CPP_WRAPPER)()
    calls = _count_plain_calls(monkeypatch)
    x2, w2 = torch.randn(4, 8), torch.randn(8, 8)
    replay = compiled.bind([x2, w2])
    assert calls == [1]
    torch.testing.assert_close(replay(), _affine(x2, w2))


def test_a_compiled_piece_keeps_no_tensors_of_its_last_run() -> None:
    """A piece (compile_with_inductor) is called, never bound: it holds neither the
    inputs nor the outputs of the compile's or the index load's run, cold or warm."""
    import gc
    import weakref

    from torch._inductor.utils import fresh_cache

    from decodegraph.platforms.base import trace
    from decodegraph.platforms.cpu_graph import compile_with_inductor

    pieces, refs = [], []
    with fresh_cache():
        for _ in range(2):  # a compile, then a load from the index
            x, w = torch.randn(4, 8), torch.randn(8, 8)
            pieces.append(compile_with_inductor(trace(_affine, [x, w]), [x, w], _CPP_WRAPPER))
            refs.append(weakref.ref(x))
            del x, w
    gc.collect()
    assert [r() for r in refs] == [None, None]
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    for piece in pieces:
        torch.testing.assert_close(piece(x, w), _affine(x, w))


def test_a_module_without_a_cpp_entry_is_not_bound() -> None:
    from decodegraph.platforms import inductor_cpp

    not_a_module = lambda args: args  # noqa: E731 - a plain function, no entry beside it
    assert inductor_cpp.bind_entry(not_a_module, [torch.ones(1)], 1) is None


def test_a_python_wrapper_graph_is_called_through_its_modules_call() -> None:
    from torch._inductor.utils import fresh_cache

    from decodegraph.platforms import inductor_cpp

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with fresh_cache():
        graph = CpuGraph("g", _affine, [x, w], True, {"cpp_wrapper": False})
    torch.testing.assert_close(graph.replay(), _affine(x, w))
    not_a_module = lambda args: args  # noqa: E731 - a plain function, no entry beside it
    assert inductor_cpp.entry_call(not_a_module) is not_a_module


@pytest.mark.parametrize(
    "tree",
    [
        torch.ones(1),
        (torch.ones(1), torch.zeros(2)),
        [torch.ones(1)],
        {"a": torch.ones(1)},
        (torch.ones(1), (torch.ones(2),)),
    ],
    ids=["leaf", "tuple", "list", "dict", "nested"],
)
def test_the_replay_unflattener_rebuilds_every_output_structure(tree: object) -> None:
    from torch.utils import _pytree as pytree

    from decodegraph.platforms.cpu_graph import _unflattener

    leaves, spec = pytree.tree_flatten(tree)
    out = _unflattener(spec)(leaves)
    assert pytree.tree_structure(out) == spec
    assert all(a is b for a, b in zip(pytree.tree_leaves(out), leaves, strict=True))


# ---------------------------------------------------------------- rows traced symbolic


def test_a_trace_of_symbolic_rows_runs_at_every_row_count_of_its_range() -> None:
    from decodegraph.platforms.base import trace_rows

    weight = torch.randn(4, 3)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x @ weight + y).relu()

    gm = trace_rows(fn, [torch.randn(16, 4), torch.randn(16, 3)], fewest_rows=5)
    for n in (5, 9, 16):
        x, y = torch.randn(n, 4), torch.randn(n, 3)
        torch.testing.assert_close(gm(x, y), fn(x, y))


@pytest.mark.parametrize(
    "branch",
    [
        lambda x: x * 2 if x.shape[0] <= 8 else x * 3,  # a path for some counts only
        lambda x: x.view(int(x.shape[0]), 4) * 2,  # the count made a constant
    ],
    ids=["branch", "constant"],
)
def test_a_trace_of_symbolic_rows_that_depends_on_the_count_fails(branch: object) -> None:
    """make_fx records such assumptions as guards without checking them against the
    range; trace_rows does, instead of returning a graph wrong for part of it."""
    from decodegraph.platforms.base import RowsGuardError, trace_rows

    with pytest.raises(RowsGuardError, match="row count"):
        trace_rows(branch, [torch.randn(16, 4)], fewest_rows=5)
