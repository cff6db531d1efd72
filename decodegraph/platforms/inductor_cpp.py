"""How the CPU graphs' Inductor modules are built and called (platforms/cpu_graph.py).

A C++ wrapper module is Python that holds the generated C++ as text and, when it loads,
has the compiler build it and loads the library. `cpp_builds_in_background` lets the
module load at once while the compiler runs in a thread (the C++ wrapper and its kernels
side by side), so the next graph lowers meanwhile; the entry function waits for its
build on its first call. `entry_call` calls a module's C++ entry with its inputs'
handles, without the module's Python loop over them; `bind_entry` binds the entry to a
graph's inputs once (csrc/graph_entry.h: aliases without Python objects), so that a
replay makes no handle from a Python tensor at all, and gives a builtin function of no
arguments that calls it (a replay's call is a C method's, not a ctypes call's).

Both lean on Inductor's code cache (`CppWrapperCodeCache.load_pybinding_async`,
`codecache._worker_compile_cpp`) and on the generated module's globals; where those are
missing, a module builds as it loads and is called through its `call`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from decodegraph.platforms import inductor_static

# inductor_entry_impl(AtenTensorHandle* inputs, AtenTensorHandle* outputs), as the C++
# wrapper module defines it.
_ENTRY_IMPL_SYMBOL = "_Z19inductor_entry_implPP16AtenTensorOpaqueS1_"

# The threads that run Inductor's C++ builds under cpp_builds_in_background.
_build_pool: ThreadPoolExecutor | None = None


def _forget_build_pool() -> None:
    """In a forked child (graphs/forked_build.py): the pool's threads were not copied."""
    global _build_pool
    _build_pool = None


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_build_pool)


@contextlib.contextmanager
def cpp_builds_in_background() -> Iterator[None]:
    """While active, a C++ wrapper module that Inductor loads submits its compiler runs
    to a build thread and gets an entry function that waits for them on its first call,
    instead of building before it loads (a library built already loads on that call
    too); the wrapper and its kernels compile side by side."""
    global _build_pool
    from torch._inductor import codecache
    from torch._inductor.codecache import CppWrapperCodeCache

    if not (
        hasattr(CppWrapperCodeCache, "load_pybinding_async")
        and hasattr(codecache, "_worker_compile_cpp")
    ):
        yield  # an Inductor without these builds as it loads: correct, only slower
        return
    if _build_pool is None:
        workers = os.cpu_count() or 1
        _build_pool = ThreadPoolExecutor(workers, thread_name_prefix="decodegraph-c++")
    submit = _build_pool.submit

    def load_pybinding(cls: type, *args: Any, **kwargs: Any) -> _PendingEntry:
        return _PendingEntry(cls.load_pybinding_async(*args, submit_fn=submit, **kwargs))

    own = "load_pybinding" in CppWrapperCodeCache.__dict__
    original = CppWrapperCodeCache.__dict__.get("load_pybinding")
    CppWrapperCodeCache.load_pybinding = classmethod(load_pybinding)  # type: ignore[method-assign, assignment]
    original_worker = codecache._worker_compile_cpp
    codecache._worker_compile_cpp = _compile_side_by_side
    try:
        yield
    finally:
        codecache._worker_compile_cpp = original_worker
        if own:
            CppWrapperCodeCache.load_pybinding = original  # type: ignore[method-assign]
        else:
            del CppWrapperCodeCache.load_pybinding


def _compile_side_by_side(lock_path: str, builders: Sequence[Any]) -> None:
    """Inductor's build of a C++ wrapper module (its `_worker_compile_cpp`): under a file
    lock (another process may be building the same module), each builder whose output is
    missing, in order; for the wrapper, its kernels and their link, the two compiles run
    at the same time, since neither needs the other."""
    from torch._inductor.codecache import LOCK_TIMEOUT
    from torch.utils._filelock import FileLock

    def build(builder: Any) -> None:
        if not os.path.exists(builder.get_target_file_path()):
            builder.build()

    with FileLock(lock_path, timeout=LOCK_TIMEOUT):
        if len(builders) != 3:
            for builder in builders:
                build(builder)
            return
        wrapper, kernels, link = builders
        errors: list[BaseException] = []

        def build_kernels() -> None:
            try:
                build(kernels)
            except BaseException as e:  # noqa: BLE001 - raised below, in this thread
                errors.append(e)

        side = threading.Thread(target=build_kernels, name="decodegraph-c++-kernels")
        side.start()
        try:
            build(wrapper)
        finally:
            side.join()
        if errors:
            raise errors[0]
        build(link)


class _PendingEntry:
    """A C++ wrapper module's entry function while its library builds: the first call
    waits for the build and loads the library."""

    __slots__ = ("_entry", "_load")

    def __init__(self, load: Callable[[], Callable[[Any], Any]]) -> None:
        self._load = load
        self._entry: Callable[[Any], Any] | None = None

    def resolve(self) -> Callable[[Any], Any]:
        if self._entry is None:
            self._entry = self._load()
        return self._entry

    def __call__(self, handles: Any) -> Any:
        return self.resolve()(handles)


def entry_call(call: Callable[[list], list]) -> Callable[[list], list]:
    """Inductor's `call` of a C++ wrapper module without its Python loop: that makes a
    tensor of every input that is not one, a handle of each, and hands the handles to
    the module's C++ entry; a graph's inputs are all tensors, so the handles are made
    in one call. For any other module (Inductor's Python wrapper), `call` itself."""
    entry = _module_entry(call)
    aoti = getattr(torch._C, "_aoti", None)
    to_handles = getattr(aoti, "unsafe_alloc_void_ptrs_from_tensors", None)
    from_handles = getattr(aoti, "alloc_tensors_by_stealing_from_void_ptrs", None)
    if entry is None or not (to_handles and from_handles):
        return call

    def direct(args: list) -> list:
        try:
            return from_handles(entry(to_handles(args)))
        except RuntimeError as error:
            full = _graph_error(str(error))
            if full == str(error):
                raise
            raise RuntimeError(full) from error

    return direct


def _graph_error(message: str) -> str:
    """A C++ wrapper's error with the reason a failed shim call stored for this thread
    (csrc/graph_entry.h's graph_error): the wrapper itself says only which call failed."""
    from decodegraph import native

    ops = native.load_cpu_ops()
    return ops.graph_error(message) if ops is not None and hasattr(ops, "graph_error") else message


def _module_entry(call: Callable[[list], list]) -> Callable[[Any], Any] | None:
    """The pybind entry function of the C++ wrapper module whose `call` this is (its
    build waited for), or None for any other function."""
    namespace = getattr(call, "__globals__", {})
    entry = namespace.get("inductor_entry")
    if namespace.get("call") is not call or entry is None:
        return None
    return entry.resolve() if isinstance(entry, _PendingEntry) else entry


def wait_for_build(call: Callable[[list], list] | None) -> None:
    """Wait for the C++ build of the module whose `call` this is, and load its library,
    without calling it (any thread); nothing for any other function."""
    if call is not None:
        _module_entry(call)


def bind_entry(
    call: Callable[[list], list], args: Sequence[torch.Tensor], num_outputs: int
) -> Callable[[], list] | None:
    """`call` (a C++ wrapper module's `call`) bound to `args`: a function of no arguments
    that runs the module's C++ entry over aliases of `args` made now, and returns the
    list of its `num_outputs` outputs. None where it cannot be bound (another kind of
    module, its entry not found, or decodegraph's CPU operators not loaded): call `call`.
    The aliases are freed with the function."""
    from decodegraph import native

    entry = _module_entry(call)
    ops = native.load_cpu_ops()
    if entry is None or ops is None or not hasattr(ops, "graph_entry_make"):
        return None
    path = getattr(getattr(entry, "__self__", None), "__file__", None)
    if not isinstance(path, str):
        return None
    try:
        library = ctypes.CDLL(path)
    except OSError:
        return None
    impl = _symbol_address(library, _ENTRY_IMPL_SYMBOL)
    if not impl:
        return None
    # A static-buffer module's entry that borrows the input handles (inductor_static).
    borrowed = _symbol_address(library, inductor_static.BORROWED_ENTRY)
    handle = ops.graph_entry_make(list(args), impl, num_outputs, borrowed)
    # A builtin function that owns the entry (graph_entry.h): a replay costs a C
    # method's call, not a ctypes call's.
    return _binder_type(ops.graph_entry_binder())(handle)


def _symbol_address(library: ctypes.CDLL, name: str) -> int:
    """The address of `name` in `library`, or 0 where it has none."""
    symbol = getattr(library, name, None)
    return (ctypes.cast(symbol, ctypes.c_void_p).value or 0) if symbol is not None else 0


# decodegraph_graph_entry_bind's prototype (the GIL held).
_binder_type = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_int64)
