"""Static intermediates in the CPU graphs' C++ wrappers (platforms/inductor_static.py)."""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decodegraph.platforms import cpu_graph_cache, inductor_cpp, inductor_static
from decodegraph.platforms.cpu import CpuPlatform
from decodegraph.platforms.cpu_graph import CpuGraph

_CPP_WRAPPER = CpuPlatform.default_inductor_options
STATIC_LINE = "static thread_local RAIIAtenTensorHandle&"


@pytest.fixture(autouse=True)
def _static_buffers_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the environment says (a test that switches them off sets it again)."""
    monkeypatch.setenv(inductor_static.ENV, "1")


def _chain(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Intermediates the wrapper allocates (each mm's output, a BLAS call at 16 rows),
    an output that is an mm's own buffer and one that is a fused kernel's."""
    h = torch.relu(x @ w) + 1
    g = torch.tanh(h @ w) * 2
    y = g @ w
    return y, (y + h).sum(dim=-1)


def _compile(x: torch.Tensor, w: torch.Tensor) -> tuple[CpuGraph, object, str]:
    """A C++ wrapper graph of _chain over x and w in a fresh Inductor cache, its module
    and the module's source (the generated C++ in it)."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache(), _sources() as sources:
        graph = CpuGraph("g", _chain, [x, w], True, _CPP_WRAPPER)
    module = [m for m in list(sys.modules.values()) if hasattr(m, "inductor_entry")][-1]
    return graph, module, sources[-1]


@contextlib.contextmanager
def _sources() -> Iterator[list[str]]:
    """The source of every module Inductor loads meanwhile, read as it loads."""
    from torch._inductor.codecache import PyCodeCache

    sources: list[str] = []
    load = PyCodeCache.load_by_key_path.__func__

    def reading(cls: type, key: str, path: str, *args: object, **kwargs: object) -> object:
        sources.append(Path(path).read_text())
        return load(cls, key, path, *args, **kwargs)

    PyCodeCache.load_by_key_path = classmethod(reading)
    try:
        yield sources
    finally:
        PyCodeCache.load_by_key_path = classmethod(load)


def test_intermediates_are_made_once_and_outputs_at_every_call(cpu_ops: object) -> None:
    x, w = torch.randn(16, 32), torch.randn(32, 32) / 8
    graph, _, source = _compile(x, w)
    assert source.count(STATIC_LINE) >= 2  # the first two mm outputs at least
    # The generated kernels get a static buffer's pointer as kept when it was made.
    static = re.findall(r"RAIIAtenTensorHandle& (buf\d+) = ", source)
    calls = [line for line in source.splitlines() if line.lstrip().startswith("cpp_fused")]
    assert calls and any("_static_data)" in line for line in calls)
    assert not [n for n in static for line in calls if f"({n}.data_ptr())" in line]
    first = graph.replay()
    kept = [t.clone() for t in first]
    for t, want in zip(first, _chain(x, w), strict=True):
        torch.testing.assert_close(t, want)
    for _ in range(3):
        x.copy_(torch.randn(16, 32))
        for got, want in zip(graph.replay(), _chain(x, w), strict=True):
            torch.testing.assert_close(got, want)
    # An earlier replay's outputs are its own: no later call wrote into them.
    for t, k in zip(first, kept, strict=True):
        assert torch.equal(t, k)


def _biased(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An addmm into an intermediate: its CPU kernel copies the bias into the output
    buffer through the dispatcher, which refuses to write an inference tensor outside
    inference mode."""
    h = torch.relu(x @ w) + 1
    return torch.addmm(torch.tanh(h), h, w).sum(dim=-1)


def test_intermediates_made_in_inference_mode_serve_calls_outside_it(cpu_ops: object) -> None:
    """The engine runs its graphs in inference mode, a test or a user's code may not; a
    thread's intermediates are made on its first call, whatever the mode then, and serve
    every later call in either mode."""
    from torch._inductor.utils import fresh_cache

    x, w = torch.randn(16, 32), torch.randn(32, 32) / 8
    with fresh_cache(), _sources() as sources, torch.inference_mode():
        graph = CpuGraph("g", _biased, [x, w], True, _CPP_WRAPPER)  # its first call
    assert STATIC_LINE in sources[-1] and "aoti_torch_cpu_addmm_out(" in sources[-1]
    for mode in (torch.no_grad, torch.enable_grad, torch.inference_mode, torch.no_grad):
        x.copy_(torch.randn(16, 32))
        with mode():
            torch.testing.assert_close(graph.replay(), _biased(x, w))


def test_threads_calling_one_module_at_once_each_get_their_own_intermediates(
    cpu_ops: object,
) -> None:
    """The entry drops the GIL while it runs, so two threads can be inside one module:
    each has its own buffers (thread-local), and each gets the bits its input gives
    alone."""
    w = torch.randn(32, 32) / 8
    _, module, _ = _compile(torch.randn(16, 32), w)
    inputs = [torch.randn(16, 32) for _ in range(2)]
    wants = [module.call([x, w]) for x in inputs]
    failures: list[str] = []
    start = threading.Barrier(2)

    def run(i: int) -> None:
        start.wait()
        for _ in range(300):
            got = module.call([inputs[i], w])
            if not all(torch.equal(g, t) for g, t in zip(got, wants[i], strict=True)):
                failures.append(f"thread {i}")
                return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_the_switch_compiles_plain_wrappers_and_keys_them_apart(
    cpu_ops: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(inductor_static.ENV, "0")
    x, w = torch.randn(16, 32), torch.randn(32, 32) / 8
    graph, _, source = _compile(x, w)
    assert STATIC_LINE not in source
    for got, want in zip(graph.replay(), _chain(x, w), strict=True):
        torch.testing.assert_close(got, want)
    gm = torch.fx.symbolic_trace(lambda a: a + 1)
    keys = {cpu_graph_cache.graph_key(gm, [], [x], {}, v) for v in ("", inductor_static.VERSION)}
    assert len(keys) == 2


def test_a_static_module_is_not_served_from_the_fx_cache_to_a_plain_compile(
    cpu_ops: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor's FX graph cache keys the static modules apart (the version pass)."""
    from torch._inductor.utils import fresh_cache

    x, w = torch.randn(16, 32), torch.randn(32, 32) / 8
    with fresh_cache(), _sources() as sources:
        CpuGraph("g", _chain, [x, w], True, _CPP_WRAPPER)
        monkeypatch.setenv(inductor_static.ENV, "0")
        CpuGraph("g", _chain, [x, w], True, _CPP_WRAPPER)
    static_src, plain_src = sources[0], sources[-1]
    assert STATIC_LINE in static_src
    assert STATIC_LINE not in plain_src


def test_a_users_own_post_grad_pass_is_kept_and_the_wrapper_left_plain(cpu_ops: object) -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.utils import fresh_cache

    calls: list[int] = []

    class Mine(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            calls.append(1)

        def uuid(self) -> str:
            return "mine"

    x, w = torch.randn(16, 32), torch.randn(32, 32) / 8
    options = {**_CPP_WRAPPER, "post_grad_custom_post_pass": Mine()}
    with fresh_cache(), _sources() as sources:
        graph = CpuGraph("g", _chain, [x, w], True, options)
    source = sources[-1]
    assert calls
    assert STATIC_LINE not in source
    for got, want in zip(graph.replay(), _chain(x, w), strict=True):
        torch.testing.assert_close(got, want)


def test_past_the_budget_allocations_stay_per_call(
    cpu_ops: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inductor_static, "STATIC_BYTES", 16 * 32 * 4)  # one mm output
    x, w = torch.randn(16, 32), torch.randn(32, 32) / 8
    graph, _, source = _compile(x, w)
    assert source.count(STATIC_LINE) == 1
    for got, want in zip(graph.replay(), _chain(x, w), strict=True):
        torch.testing.assert_close(got, want)


def _in_place_into_output(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) + 1  # the mm's buffer, then a kernel in place: the output


def test_a_buffer_that_becomes_an_output_in_place_stays_per_call(cpu_ops: object) -> None:
    from torch._inductor.utils import fresh_cache

    x, w = torch.randn(16, 32), torch.randn(32, 32)
    with fresh_cache(), _sources() as sources:
        graph = CpuGraph("g", _in_place_into_output, [x, w], True, _CPP_WRAPPER)
    assert STATIC_LINE not in sources[-1]
    first = graph.replay()
    x.copy_(torch.randn(16, 32))
    second = graph.replay()
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(second, _in_place_into_output(x, w))


def test_a_bound_static_module_borrows_its_input_handles_and_the_plain_entry_still_owns(
    cpu_ops: object,
) -> None:
    """Bound, the graph's inputs are lent to the module's borrowing entry (handles made
    once): replays neither leak nor free them; the module's own entry, called after,
    still takes and frees the handles it is given."""
    import ctypes
    import gc

    x, w = torch.randn(16, 32), torch.randn(32, 32) / 8
    graph, module, _ = _compile(x, w)
    entry = inductor_cpp._module_entry(module.call)
    library = ctypes.CDLL(entry.__self__.__file__)
    assert getattr(library, inductor_static.BORROWED_ENTRY, None) is not None
    graph.replay()
    uses = torch._C._storage_Use_Count(w.untyped_storage()._cdata)
    for _ in range(50):
        x.copy_(torch.randn(16, 32))
        for got, want in zip(graph.replay(), _chain(x, w), strict=True):
            torch.testing.assert_close(got, want)
    gc.collect()
    assert torch._C._storage_Use_Count(w.untyped_storage()._cdata) == uses
    for _ in range(50):
        module.call([x, w])
    gc.collect()
    assert torch._C._storage_Use_Count(w.untyped_storage()._cdata) == uses


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ x.t())  # an intermediate in a buffer of its own
    return h[idx] * 2


def test_a_borrowed_call_that_fails_raises_and_the_next_call_runs(cpu_ops: object) -> None:
    """An index out of range makes the module throw halfway, after it let go of some of
    the lent handles: the error reaches Python, and the next replay lends new handles."""
    from torch._inductor.utils import fresh_cache

    x, idx = torch.randn(16, 32), torch.tensor([1, 3])
    with fresh_cache():
        graph = CpuGraph("g", _gather, [x, idx], True, _CPP_WRAPPER)
    torch.testing.assert_close(graph.replay(), _gather(x, idx))
    idx.fill_(1000)
    with pytest.raises(RuntimeError):
        graph.replay()
    idx.copy_(torch.tensor([2, 5]))
    torch.testing.assert_close(graph.replay(), _gather(x, idx))


def _views(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An intermediate handed to an opaque operator (mm at 16 rows: a BLAS call) through
    views at offsets, and a graph input through one."""
    h = torch.relu(x @ w) + 1
    return h[:, 8:24] @ w[:16] + h[:, :16] @ w[8:24] + x[:, 4:20] @ w[:16]


def test_views_of_static_intermediates_are_made_once_and_give_the_same_values(
    cpu_ops: object,
) -> None:
    from torch._inductor.utils import fresh_cache

    x, w = torch.randn(16, 32), torch.randn(32, 32) / 8
    with fresh_cache(), _sources() as sources:
        graph = CpuGraph("g", _views, [x, w], True, _CPP_WRAPPER)
    source = sources[-1]
    made_once = [line for line in source.splitlines() if "_view_" in line and STATIC_LINE in line]
    assert len(made_once) == 2  # h's two views
    assert "reinterpret_tensor_wrapper(arg0_1" in source  # x's: made at each call
    for _ in range(3):
        x.copy_(torch.randn(16, 32))
        torch.testing.assert_close(graph.replay(), _views(x, w))
