"""CPU graphs: a traced op graph (make_fx), optionally compiled by Inductor.

A CPU graph is replayed without re-running the model's Python and bakes host values
exactly like a device graph, so the CPU tests catch the same class of bug (docs/design.md
§6). Weights and other tensors the traced code reads stay the model's own tensors: they
become trailing inputs of the compiled function, never copies.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from decodegraph.platforms import cpu_graph_cache, inductor_static
from decodegraph.platforms.base import (
    DeviceGraph,
    GraphFn,
    GraphNotCached,
    graph_build_lock,
    rows_symbolic,
    trace,
    trace_rows,
)
from decodegraph.platforms.inductor_cpp import (
    bind_entry,
    cpp_builds_in_background,
    entry_call,
    wait_for_build,
)

logger = logging.getLogger(__name__)

# Per thread: whether start_inductor_compile may compile (index_only).
_index_only = threading.local()


@contextlib.contextmanager
def index_only() -> Iterator[None]:
    """On this thread, while active: start_inductor_compile gives only a module the
    compiled-graph index holds, and raises GraphNotCached before compiling otherwise
    (Platform.cached_graphs_only)."""
    before = getattr(_index_only, "active", False)
    _index_only.active = True
    try:
        yield
    finally:
        _index_only.active = before


# Inductor's vector-ISA probe, started early by start_vector_isa_probe.
_isa_probe: threading.Thread | None = None


def start_vector_isa_probe(vec_isa_ok: bool | None) -> None:
    """Run Inductor's vector-ISA choice in a thread of its own, once per process.

    Inductor makes it before its first CPU graph: a test library per ISA feature, each
    compiled (cold) and loaded by a child Python (every process), mostly time spent
    waiting on those processes. Here each candidate ISA is checked in a thread of its
    own, side by side, and the pick then finds every answer made. Started while the
    model loads, it is done or nearly so when the first graph compiles;
    compile_with_inductor waits for it rather than probe again beside it. `vec_isa_ok`:
    Inductor's `cpp.vec_isa_ok` as the compiles will set it (the process keeps the
    probe's answer).
    """
    global _isa_probe
    if _isa_probe is not None:
        return

    def probe() -> None:
        try:
            import torch._inductor.config as inductor_config
            from torch._inductor import cpu_vec_isa

            # Inductor's config patches are per thread.
            def check(isa: object) -> None:
                with inductor_config.patch({"cpp.vec_isa_ok": vec_isa_ok}):
                    bool(isa)

            # Each ISA's checks (compiles and child processes, one after another within
            # an ISA) side by side: each answer is cached on its ISA object, where the
            # pick below finds it.
            checks = [
                threading.Thread(target=check, args=(isa,), name="decodegraph-isa-check")
                for isa in _isa_candidates(cpu_vec_isa)
            ]
            for thread in checks:
                thread.start()
            for thread in checks:
                thread.join()
            with inductor_config.patch({"cpp.vec_isa_ok": vec_isa_ok}):
                cpu_vec_isa.pick_vec_isa()  # cached for the process: the compiles reuse it
        except Exception as e:  # noqa: BLE001 - the compile will probe for itself
            logger.debug("early vector-ISA probe failed: %s", e)

    _isa_probe = threading.Thread(target=probe, name="decodegraph-isa-probe", daemon=True)
    _isa_probe.start()


def _isa_candidates(cpu_vec_isa: Any) -> list[Any]:
    """Inductor's x86 vector ISAs whose every feature this CPU reports, the ones its pick
    will check (none elsewhere: the pick checks those itself)."""
    try:
        features = set(cpu_vec_isa.x86_isa_checker())
        if not features:
            return []
        return [
            isa
            for isa in cpu_vec_isa.supported_vec_isa_list
            if all(f in features for f in str(isa).split())
        ]
    except AttributeError:  # another Inductor: its pick checks them one after another
        return []


def _wait_for_isa_probe() -> None:
    if _isa_probe is not None:
        _isa_probe.join()


def warm_process_wide_traces() -> None:
    """Make, now, what Inductor traces with torch.fx's own tracer the first time it lowers
    a graph in a process (a module of one identity node): that tracer patches
    torch.nn.Module's __call__ for the whole process, and a step on another thread would
    then call its modules through it (platforms/base.py: module_call_lock). Call it on
    the thread that steps, before a compile on another thread."""
    try:
        from torch._inductor.loop_body import InterpreterShim

        InterpreterShim._dummy_gm()  # cached for the process
    except (ImportError, AttributeError):  # another Inductor: nothing known to warm
        pass


def compile_with_inductor(
    gm: torch.fx.GraphModule,
    inputs: Sequence[torch.Tensor],
    options: dict[str, object] | None = None,
) -> Callable[..., object]:
    """Compile a traced graph with Inductor: `start_inductor_compile` and wait for it."""
    return start_inductor_compile(gm, inputs, options)()


def start_inductor_compile(
    gm: torch.fx.GraphModule,
    inputs: Sequence[torch.Tensor],
    options: dict[str, object] | None = None,
    bind_next: bool = False,
    fewest_rows: int = 0,
    runs_later: bool = False,
) -> PendingCompile:
    """Compile a traced graph with Inductor (no dynamo front end involved) into a
    callable of the same inputs, returning what the graph returns. Returns a function
    to call once: it waits for the compile's C++ build and gives that callable.

    Inductor's work in Python is done when this returns; the C++ compiler runs for it in
    a thread meanwhile (its compiles are other processes), so that a caller with several
    graphs to compile lowers the next while the compiler builds the last, and waits for
    them all at the end. The process's first C++ module (the wrapper's precompiled
    header, the vector-ISA choice) is still made here.

    The tensors the graph reads as attributes (weights, rotary tables) become trailing
    inputs, so that Inductor's own compiled function can be called with one flat list,
    without AOTAutograd's runtime wrappers around it: they handle parameters, input
    mutations and outputs aliasing inputs, none of which an inference graph has (its KV
    writes are inside opaque ops), and cost a noticeable share of a small replay
    (docs/performance.md). Where that function
    cannot be taken (AOTAutograd merged or dropped inputs), or does not reproduce the
    wrapped one at capture, the wrapped one is used. `gm` is changed in place: its tensor
    attributes become placeholders.

    The compile runs in a tracing context whose fake mode has a shape env: Inductor's FX
    graph cache keeps its guards in it, and bypasses itself without one, so a graph
    from make_fx (no dynamo) would be compiled afresh in every process. Every shape is
    static, so there are no guards to keep. A graph traced the same way before, whose
    module is still in Inductor's cache, skips the compile altogether (cpu_graph_cache).

    The callable has run once over `inputs` (a smoke test and warm-up) by the time the
    waiting function gives it. With `bind_next` (a caller that binds it to `inputs` at
    once, CpuGraph) it keeps that run's outputs for the bind's check; otherwise it holds
    no tensor of the run.

    With `fewest_rows` (a graph from trace_rows) the rows of `inputs` stay symbolic, from
    that many to theirs: the module runs over any row count in that range, its
    intermediates allocated per call.

    With `runs_later` nothing runs over `inputs` until the waiting function is called,
    not even a module from the index (a compile on a thread of its own, while another
    thread's steps write into those inputs: they hold a batch to run only when that
    thread says so). `PendingCompile.wait_built` waits for the C++ build without running.
    """
    _wait_for_isa_probe()
    node_meta = cpu_graph_cache.node_metadata(gm)
    # make_fx leaves fake values made under separate fake modes; Inductor wants one.
    for node in gm.graph.nodes:
        node.meta.pop("val", None)
        node.meta.pop("tensor_meta", None)
    constants = _lift_tensor_attributes(gm)
    args = [*inputs, *constants]
    options = dict(options or {})
    if options.get("cpp_wrapper") and _calls_c10d(gm):
        # A c10d functional collective takes a process group's name, which Inductor's
        # C++ wrapper cannot pass yet: the Python wrapper calls such a graph. (The
        # shared-memory collectives take a tensor and ints, and leave it on.)
        options["cpp_wrapper"] = False
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    spec = pytree.tree_flatten(output.args[0])[1]
    # The C++ wrapper's intermediates allocated once (platforms/inductor_static.py).
    static = inductor_static.applies(options) and not fewest_rows
    # What the module's wrapper is, besides the graph: its rows' range or its static
    # buffers' version, or neither.
    if fewest_rows:
        variant = f"rows from {fewest_rows}"
    elif static:
        variant = inductor_static.VERSION
    else:
        variant = ""
    key = cpu_graph_cache.graph_key(gm, node_meta, args, options, variant)
    tensor_inputs = all(isinstance(a, torch.Tensor) for a in args)
    entry = cpu_graph_cache.load(key, options)
    if entry is not None:

        def from_index() -> _FlatCall | None:
            outputs = _run_indexed(key, entry.call, args, spec)
            if outputs is None:
                return None
            logger.debug("graph of %d inputs: Inductor's module from an earlier compile", len(args))
            last_run = (inputs, outputs) if bind_next else None
            return _FlatCall(
                entry.call, constants, spec, tensor_inputs, last_run, key, entry.bind_checked
            )

        if runs_later:

            def finish_from_index() -> _FlatCall:
                compiled = from_index()
                if compiled is None:
                    raise RuntimeError(f"compiled-graph entry {key} failed at its first run")
                return compiled

            return PendingCompile(finish_from_index)
        compiled = from_index()
        if compiled is not None:
            return PendingCompile(lambda: compiled, done=True)
    if getattr(_index_only, "active", False):
        raise GraphNotCached(f"compiled-graph entry {key}")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    inner: list[Callable[[list], list]] = []

    def capture_inner(graph: torch.fx.GraphModule, example_inputs: list, **kw: object) -> object:
        compiled = compile_fx_inner(graph, example_inputs, **kw)
        # Usable only if it takes exactly our flat inputs (nothing lifted or dropped).
        if len(example_inputs) == len(args):
            inner.append(compiled)
        return compiled

    if fewest_rows:
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        fake_args = [
            fake_mode.from_tensor(a, symbolic_context=rows_symbolic(a, fewest_rows))
            if i < len(inputs)
            else fake_mode.from_tensor(a, static_shapes=True)
            for i, a in enumerate(args)
        ]
    else:
        fake_mode = FakeTensorMode(static_shapes=True, shape_env=ShapeEnv())
        # Static shapes: inputs that are already fake in the context's mode are taken as
        # they are, where real ones would get a symbol for every dimension.
        fake_args = [fake_mode.from_tensor(a, static_shapes=True) for a in args]
    # Not AOTAutograd's cache: a hit there skips inner_compile, and with it the direct
    # call of Inductor's function; the FX graph cache below it still spares the lowering.
    with (
        graph_build_lock,
        torch.no_grad(),
        inductor_config.patch(options),
        functorch_config.patch(enable_autograd_cache=False),
        tracing(TracingContext(fake_mode)),
        cpp_builds_in_background(),
        inductor_static.static_buffers(static),
    ):
        wrapped = compile_fx(gm, fake_args, inner_compile=capture_inner)

    def finish() -> Callable[..., object]:
        with torch.no_grad():
            expected = pytree.tree_leaves(wrapped(*args))  # waits for the build
            if len(inner) == 1 and len(expected) == spec.num_leaves:
                got = inner[0](list(args))
                if len(got) == len(expected) and all(
                    isinstance(a, torch.Tensor) and torch.equal(a, b)
                    for a, b in zip(got, expected, strict=True)
                ):
                    # After its first call, the compiled graph's own callable (the wrapper
                    # around it only records metrics and closes compile-time caches).
                    fast = getattr(inner[0], "current_callable", None) or inner[0]
                    module_key = getattr(inner[0], "cache_key", None)
                    indexed = isinstance(module_key, str) and fast is not inner[0]
                    if indexed:
                        cpu_graph_cache.save(key, module_key)
                    logger.debug(
                        "graph of %d inputs: calling Inductor's function directly", len(args)
                    )
                    last_run = (inputs, got) if bind_next else None
                    return _FlatCall(
                        fast, constants, spec, tensor_inputs, last_run, key if indexed else None
                    )
        logger.debug("Inductor's inner function not usable here; keeping AOTAutograd's wrapper")
        return lambda *xs: wrapped(*xs, *constants)

    def wait_built() -> None:
        if inner:
            wait_for_build(getattr(inner[0], "current_callable", None))

    return PendingCompile(finish, wait_built=wait_built)


class PendingCompile:
    """What start_inductor_compile gives: `finish`, to call once, which waits for the
    C++ build, runs the module over the compile's inputs and gives the callable; `done`
    where there is nothing left to wait for or run (a module from the index, run
    already); `wait_built()` waits for the build only (any thread)."""

    def __init__(
        self,
        finish: Callable[[], Callable[..., object]],
        done: bool = False,
        wait_built: Callable[[], None] | None = None,
    ) -> None:
        self._finish = finish
        self.done = done
        self._wait_built = wait_built

    def __call__(self) -> Callable[..., object]:
        return self._finish()

    def wait_built(self) -> None:
        if self._wait_built is not None:
            self._wait_built()


class _FlatCall:
    """`fn` (Inductor's function of one flat list) as a callable of the graph's inputs,
    returning what the graph returns; straight into its C++ entry where every input is a
    tensor (`tensor_inputs`, as they were at the compile). `bind(inputs)`: the same over
    fixed inputs, as a function of no arguments (CpuGraph's replay).

    `last_run`: (inputs, the output leaves) of the plain call just made over them at the
    compile or the index load, which the first bind over the same inputs checks against
    instead of calling again (a whole forward of the model); bind at once, before
    anything writes into those inputs.

    `index_key`: the graph's compiled-graph index entry, where it has one; a bound entry
    that passes its check is recorded there (`bind_checked`), and a later process
    binding the same module binds without the check's two forwards."""

    def __init__(
        self,
        fn: Callable[[list], list],
        constants: list[torch.Tensor],
        spec: pytree.TreeSpec,
        tensor_inputs: bool,
        last_run: tuple[Sequence[torch.Tensor], list] | None = None,
        index_key: str | None = None,
        bind_checked: bool = False,
    ) -> None:
        self._fn = fn
        self._direct = entry_call(fn) if tensor_inputs else fn
        self._constants = constants
        self._spec = spec
        self._tensor_inputs = tensor_inputs
        self._last_run = last_run
        self._index_key = index_key
        self._bind_checked = bind_checked

    def __call__(self, *xs: torch.Tensor) -> object:
        return pytree.tree_unflatten(self._direct([*xs, *self._constants]), self._spec)

    def bind(self, xs: Sequence[torch.Tensor]) -> Callable[[], object]:
        """The C++ entry bound to aliases of `xs` and the weights (inductor_cpp.bind_entry),
        checked once against a plain call; a plain call of `xs` where it cannot be bound
        or gives other outputs."""
        plain = functools.partial(self, *xs)
        last_run, self._last_run = self._last_run, None
        if not self._tensor_inputs:
            return plain
        spec = self._spec
        bound = bind_entry(self._fn, [*xs, *self._constants], spec.num_leaves)
        if bound is None:
            return plain
        unflatten = _unflattener(spec)
        if self._bind_checked:
            return lambda: unflatten(bound())
        with torch.no_grad():
            if last_run is not None and _same_tensors(last_run[0], xs):
                expected = last_run[1]
            else:
                expected = pytree.tree_leaves(plain())
            try:
                got = bound()
            except RuntimeError as e:
                logger.warning("a graph's bound C++ entry failed (%s); calling it plainly", e)
                return plain
        if len(got) != len(expected) or not all(
            isinstance(a, torch.Tensor) and torch.equal(a, b)
            for a, b in zip(got, expected, strict=True)
        ):
            logger.warning("a graph's bound C++ entry gave other outputs; calling it plainly")
            return plain
        if self._index_key is not None:
            cpu_graph_cache.mark_bind_checked(self._index_key)
        return lambda: unflatten(bound())


def _same_tensors(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _unflattener(spec: pytree.TreeSpec) -> Callable[[list], object]:
    """`pytree.tree_unflatten(leaves, spec)` as a function of the leaves, without the
    tree walk where the spec is one tensor or a flat tuple or list of them (a graph's
    outputs)."""
    if spec.is_leaf():
        return lambda leaves: leaves[0]
    children = [spec.child(i) for i in range(spec.num_children)] if hasattr(spec, "child") else []
    if spec.type in (tuple, list) and children and all(c.is_leaf() for c in children):
        return spec.type
    return functools.partial(_unflatten, spec=spec)


def _unflatten(leaves: list, spec: pytree.TreeSpec) -> object:
    return pytree.tree_unflatten(leaves, spec)


def _run_indexed(
    key: str, cached: Callable[[list], list], args: list[torch.Tensor], spec: pytree.TreeSpec
) -> list | None:
    """The outputs of the index's module for `key` once it has run over `args` and
    returned what the graph returns; None (a miss: compile afresh) where it fails."""
    try:
        with torch.no_grad():
            got = cached(list(args))
    except Exception as e:  # noqa: BLE001 - a module that fails is a miss
        logger.warning("compiled-graph entry %s failed (%s); compiling afresh", key, e)
        return None
    if isinstance(got, (list, tuple)) and len(got) == spec.num_leaves:
        return list(got)
    logger.warning("compiled-graph entry %s returned %s; compiling afresh", key, type(got))
    return None


def _calls_c10d(gm: torch.fx.GraphModule) -> bool:
    return any(
        n.op == "call_function" and str(n.target).startswith("_c10d_functional.")
        for n in gm.graph.nodes
    )


def _lift_tensor_attributes(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Turn every tensor attribute the graph reads into a trailing placeholder (one per
    attribute, however often it is read); returns the tensors in placeholder order."""
    tensors: list[torch.Tensor] = []
    lifted: dict[str, torch.fx.Node] = {}
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    for node in nodes:
        if node.op != "get_attr":
            continue
        target = node.target
        if target not in lifted:
            owner, _, name = target.rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            value = getattr(module, name)
            if not isinstance(value, torch.Tensor):
                continue
            anchor = gm.graph.inserting_after(last) if last else gm.graph.inserting_before(nodes[0])
            with anchor:
                last = lifted[target] = gm.graph.placeholder(f"lifted_{len(tensors)}")
            tensors.append(value)
            delattr(module, name)  # else AOTAutograd would lift it again, as a parameter
        node.replace_all_uses_with(lifted[target])
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return tensors


def _returns_one(gm: torch.fx.GraphModule) -> bool:
    """Whether the traced function returns one tensor (not a tuple or list of them)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return not isinstance(output.args[0], (tuple, list))


def _as_returned(out: Any, single: bool) -> Any:
    """A graph's outputs as the traced function returned them: a compiled module returns
    a list even for one tensor."""
    return out[0] if single and isinstance(out, (list, tuple)) else out


class CpuGraph(DeviceGraph):
    """A traced op graph replayed without running the model's Python.

    Like a device graph it binds its inputs and bakes host values (ints, the attention
    params id) at trace time; only the attention op's own code runs at replay.
    """

    def __init__(
        self,
        name: str,
        fn: GraphFn,
        inputs: Sequence[torch.Tensor],
        use_inductor: bool,
        inductor_options: dict[str, object] | None = None,
        decompositions: dict | None = None,
        defer: bool = False,
        runs_later: bool = False,
    ) -> None:
        super().__init__(name, inputs)
        # `runs_later` (made on a thread of its own while steps use the inputs): traced on
        # fakes, and nothing runs over the inputs until finish().
        self.graph_module = trace(fn, inputs, decompositions, on_fakes=runs_later)
        # A compiled graph returns a list even for one tensor; give back what fn returns.
        self._single_output = _returns_one(self.graph_module)
        self._pending: PendingCompile | None = None
        # What a replay calls: the callable over the bound inputs, once finished.
        self._bound: Callable[[], object] = self._finish_then_run
        if use_inductor:
            # With `defer`, its C++ builds while the caller compiles the next graph;
            # finish() waits for it and runs it once, so a failure still shows at start-up.
            # Until then a replay finishes first.
            self._pending = start_inductor_compile(
                self.graph_module, inputs, inductor_options, bind_next=True, runs_later=runs_later
            )
            # A module from the index has run over the inputs already: bound now, its
            # check reuses that run (before the next graph's dummy batch overwrites them).
            if not runs_later and (not defer or self._pending.done):
                self.finish()
        elif runs_later:
            self._pending = PendingCompile(lambda: self.graph_module)
        else:
            self._bound = functools.partial(self.graph_module, *self.inputs)
            self._run()  # one run now, so a failure shows at start-up

    def wait_built(self) -> None:
        if self._pending is not None:
            self._pending.wait_built()

    def finish(self) -> None:
        if self._pending is not None:
            compiled = self._pending()
            self._pending = None
            bind = getattr(compiled, "bind", None)
            if bind is not None:
                self._bound = bind(self.inputs)
            else:
                self._bound = functools.partial(compiled, *self.inputs)

    def _finish_then_run(self) -> object:
        self.finish()
        return self._bound()

    def _run(self) -> Any:
        out = self._bound()
        return _as_returned(out, self._single_output)


class DynamicRowsCpuGraph(DeviceGraph):
    """One traced op graph for every row count (Platform.make_dynamic_graph): traced with
    the rows of its inputs symbolic, compiled once, and replayed over the first n rows of
    the bound inputs. Other tensors the graph reads (weights, KV caches, the attention
    params' metadata) are the same tensors at every replay. It is not bound like a
    CpuGraph: each replay passes its views of the inputs, and the module allocates its
    intermediates for that row count."""

    def __init__(
        self,
        name: str,
        fn: GraphFn,
        inputs: Sequence[torch.Tensor],
        fewest_rows: int,
        use_inductor: bool,
        inductor_options: dict[str, object] | None = None,
        decompositions: dict | None = None,
        runs_later: bool = False,
    ) -> None:
        super().__init__(name, inputs)
        self.rows = (fewest_rows, min(t.shape[0] for t in inputs))
        self.graph_module = trace_rows(fn, inputs, fewest_rows, decompositions)
        self._single_output = _returns_one(self.graph_module)
        self._pending: PendingCompile | None = None
        self._call: Callable[..., object] = self.graph_module
        if use_inductor:
            # Its C++ builds while the caller makes the next graph (finish waits).
            self._pending = start_inductor_compile(
                self.graph_module,
                inputs,
                inductor_options,
                fewest_rows=fewest_rows,
                runs_later=runs_later,
            )
        elif runs_later:
            self._pending = PendingCompile(self._first_run)
        else:
            self._run()  # one run now, so a failure shows at start-up

    def wait_built(self) -> None:
        if self._pending is not None:
            self._pending.wait_built()

    def finish(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._call = pending()

    def _first_run(self) -> Callable[..., object]:
        """The traced graph, not compiled, after one run (put off until finish)."""
        self._run()
        return self.graph_module

    def _run(self) -> Any:
        return self._run_rows(self.rows[1])

    def replay_rows(self, num_rows: int) -> Any:
        if not self.rows[0] <= num_rows <= self.rows[1]:
            raise ValueError(f"graph {self.name}: {num_rows} rows, not in {list(self.rows)}")
        self.num_replays += 1
        return self._run_rows(num_rows)

    def _run_rows(self, num_rows: int) -> Any:
        self.finish()
        out = self._call(*(t[:num_rows] for t in self.inputs))
        return _as_returned(out, self._single_output)
