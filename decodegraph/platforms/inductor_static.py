"""Static intermediate buffers for the CPU graphs' C++ wrappers (platforms/cpu_graph.py).

Inductor's C++ wrapper allocates each intermediate buffer of a graph at every call
(`aoti_torch_empty_strided`: a tensor object and its storage) and frees it when the graph
is done with it; at batch 1 on a small model those objects are a noticeable share of a
replay (docs/performance.md). A device graph has no such cost: its intermediates live
at fixed addresses from capture on. `static_buffers()` makes a CPU graph's wrapper do the
same. Each intermediate it allocates is made once, on the wrapper's first call in a
thread (outside inference mode, whatever the mode of that call), and kept for the
process (a thread-local handle per allocation site); later calls, in any mode, reuse it,
as Inductor's own buffer reuse already reuses a freed buffer within a call. Inductor
never reads an intermediate before writing it, so what a call leaves behind is never
seen by the next. A view of a static intermediate that the wrapper hands an opaque
operator (the attention's q, k and v, three per layer), at a layout known statically, is
made once per thread the same way, instead of a tensor object made and freed around each
call; and the generated kernels get a static buffer's data pointer as kept when the
buffer was made, not from a call into libtorch per argument per call.

What stays per call: every buffer a graph output is or aliases (a caller may hold the
outputs of one replay past the next, and the graph runner's first-replay checks compare
two calls' outputs), the outputs of opaque operators (they allocate their own), and
intermediates past STATIC_BYTES per module (a large prefill graph keeps Inductor's
reuse-planned peak rather than one buffer per allocation site). A thread's buffers are
never freed (they are few, and a thread-local destructor at process exit could run after
the allocator's teardown). Two graphs that compiled to the same module (two engines of
one model in a process) share its buffers, which is safe because calls in one thread
never overlap. DECODEGRAPH_CPU_STATIC_BUFFERS=0 compiles plain wrappers.

The module's inputs are lent, not given, where the caller can lend them. Inductor's entry
takes a handle per input and frees each when the graph is done with it, so a caller
makes one per input per call (a graph of stories260K has 55 inputs, most of them
weights). A static module also exports BORROWED_ENTRY, which runs the same entry with a
thread-local flag set, under which every input is given back instead of freed; a bound
graph (csrc/graph_entry.h) makes its handles once and lends them to every call. A module
that returns an input, or moves one, has no such entry. The usual entry (the module's
Python `call`) keeps Inductor's ownership.

The wrapper is Inductor's CppWrapperCpu with some methods overridden; it is registered
for the CPU device only while `static_buffers()` is active (the graph's compile), and
a post-grad pass that changes nothing but carries VERSION keeps its modules apart from
plain ones in Inductor's FX graph cache (and cpu_graph_cache's index keys them by it).
An Inductor without these hooks compiles plain wrappers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

ENV = "DECODEGRAPH_CPU_STATIC_BUFFERS"
# Intermediates made static per module, in bytes; past it, allocations stay per call.
STATIC_BYTES = 16 << 20
# The borrowed-inputs entry of a static module (csrc/graph_entry.h calls it), and the
# thread's flag that it sets while the usual entry runs under it.
BORROWED_ENTRY = "decodegraph_entry_borrowed"
BORROWED_FLAG = "decodegraph_borrowed_inputs"
_BORROWED_ENTRY = f"""
extern "C" void {BORROWED_ENTRY}(AtenTensorHandle* input_handles, AtenTensorHandle* output_handles) {{
    {BORROWED_FLAG} = true;
    try {{
        inductor_entry_impl(input_handles, output_handles);
    }} catch (...) {{
        {BORROWED_FLAG} = false;
        throw;
    }}
    {BORROWED_FLAG} = false;
}}
"""
# Bump when the generated code changes: the FX graph cache key of static modules.
VERSION = "decodegraph-static-buffers-6"
# A static intermediate (or view of one) is made outside inference mode, whatever the
# mode of the call that makes it: an inference tensor cannot be written outside
# inference mode through the dispatcher (addmm's kernel copies its bias into the output
# so), and a thread's intermediates serve its calls in any mode.
NORMAL_TENSORS = "c10::InferenceMode normal_tensors(false);"
# A pointer argument of a generated kernel's call, as the C++ wrapper writes it.
_DATA_PTR_ARG = re.compile(r"\(([^()]+\*)\)\((\w+)\.data_ptr\(\)\)")


def applies(options: dict[str, object]) -> bool:
    """Whether a CPU graph compiled under Inductor `options` gets static buffers: a C++
    wrapper, DECODEGRAPH_CPU_STATIC_BUFFERS not 0 (read at each compile), and no
    post-grad pass of the user's where the version pass goes."""
    return (
        bool(options.get("cpp_wrapper"))
        and os.environ.get(ENV, "1") != "0"
        and options.get("post_grad_custom_post_pass") is None
    )


@functools.cache
def _wrapper_class() -> type | None:
    """The wrapper class, made once (None where this Inductor lacks what it overrides)."""
    try:
        from torch._inductor import ir
        from torch._inductor.codegen.common import IndentedBuffer
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
        from torch._inductor.virtualized import V
    except ImportError:
        return None

    class StaticBuffersWrapper(CppWrapperCpu):
        """CppWrapperCpu whose intermediates are allocated once per thread."""

        def __init__(self) -> None:
            super().__init__()
            # Each static buffer (or reuse of one) -> its thread-local handle's variable;
            # `<handle>_data` holds its data pointer.
            self._static: dict[str, str] = {}
            self._static_bytes = 0
            # Buffers whose memory a graph output is or aliases, once planned (None
            # before: nothing is static then).
            self._into_outputs: set[str] | None = None
            # Whether the module may lend its inputs (set with its return).
            self._borrowable = False
            # While a view declares a buffer of its own (`auto buf = <view>;`: a reuse at
            # another layout, an alias), Inductor's own view: the declaration takes it.
            self._plain_views = False

        @staticmethod
        def create(
            is_subgraph: bool,
            subgraph_name: str | None,
            parent_wrapper: Any,
            partition_signatures: Any = None,
        ) -> Any:
            return StaticBuffersWrapper()

        def run_wrapper_ir_passes(self, is_inference: bool) -> None:
            super().run_wrapper_ir_passes(is_inference)
            self._into_outputs = _reaching_outputs(self.lines)

        def _may_be_static(self, name: str, dtype: torch.dtype, shape: Any) -> bool:
            if (
                self._into_outputs is None
                or name in self._into_outputs
                or name in V.graph.graph_inputs
            ):
                return False
            try:
                numel = math.prod(int(s) for s in shape)
            except TypeError:  # a symbolic size: not static
                return False
            nbytes = numel * dtype.itemsize
            if self._static_bytes + nbytes > STATIC_BYTES:
                return False
            self._static_bytes += nbytes
            return True

        def make_allocation(  # type: ignore[override]
            self, name, device, dtype, shape, stride, allocation_shape=None, is_pinned=False
        ):
            plain = lambda: super(StaticBuffersWrapper, self).make_allocation(  # noqa: E731
                name, device, dtype, shape, stride, allocation_shape, is_pinned
            )
            if is_pinned or not self._may_be_static(
                name, dtype, shape if allocation_shape is None else allocation_shape
            ):
                return plain()
            # Inductor's own lines, written into a buffer of their own: the declarations of
            # size and stride arrays stay in the function's scope (later lines use them),
            # the allocation itself runs only while the thread's handle is empty.
            lines = IndentedBuffer()
            saved, self.wrapper_call = self.wrapper_call, lines
            try:
                declare = plain()
            finally:
                self.wrapper_call = saved
            body = list(lines._lines)
            if not all(isinstance(line, str) for line in body) or declare != (
                f"RAIIAtenTensorHandle {name}({name}_handle);"
            ):
                for line in body:  # not the shape this module knows: as Inductor wrote it
                    self.wrapper_call.writeline(line)
                return declare
            arrays = [line for line in body if line.lstrip().startswith("static constexpr")]
            keep = f"{name}_static"
            for line in arrays:
                self.wrapper_call.writeline(line)
            self.wrapper_call.writeline(
                f"static thread_local RAIIAtenTensorHandle& {keep} = *new RAIIAtenTensorHandle();"
            )
            self.wrapper_call.writeline(f"static thread_local void* {keep}_data = nullptr;")
            self.wrapper_call.writeline(f"if (!{keep}.get()) {{")
            self.wrapper_call.writeline(f"    {NORMAL_TENSORS}")
            for line in body:
                if line not in arrays:
                    self.wrapper_call.writeline("    " + line)
            self.wrapper_call.writeline(f"    {keep} = RAIIAtenTensorHandle({name}_handle);")
            self.wrapper_call.writeline(f"    {keep}_data = {keep}.data_ptr();")
            self.wrapper_call.writeline("}")
            self._static[name] = keep
            return f"RAIIAtenTensorHandle& {name} = {keep};"

        def make_buffer_free(self, buffer: Any) -> str:
            name = buffer.get_name()
            if name in self._static:
                return ""
            if name in V.graph.graph_inputs:
                return _drop_input(name)
            return super().make_buffer_free(buffer)

        def make_free_by_names(self, names_to_del: list[str]) -> str:
            inputs = [n for n in names_to_del if n in V.graph.graph_inputs]
            rest = [n for n in names_to_del if n not in self._static and n not in inputs]
            return " ".join([*map(_drop_input, inputs), super().make_free_by_names(rest)]).strip()

        def wrap_kernel_call(self, name: str, call_args: list[str]) -> str:
            # A generated kernel's pointer to a static buffer: the one kept when the
            # buffer was made, not a call into libtorch for each argument of each call.
            args = []
            for arg in call_args:
                match = _DATA_PTR_ARG.fullmatch(arg) if isinstance(arg, str) else None
                if match is not None and match[2] in self._static:
                    arg = f"({match[1]})({self._static[match[2]]}_data)"
                args.append(arg)
            return super().wrap_kernel_call(name, args)

        def codegen_reinterpret_view(  # type: ignore[override]
            self, data, size, stride, offset, writeline, dtype=None
        ) -> str:
            view = super().codegen_reinterpret_view(data, size, stride, offset, writeline, dtype)
            # A view of a static intermediate at a layout known statically (an opaque
            # operator's argument: the attention's q, k and v): made once per thread too,
            # as its base's memory never moves. Inductor's own is a tensor made and freed
            # around each call.
            if (
                self._plain_views
                or data.get_name() not in self._static
                or not view.startswith(
                    "wrap_with_raii_handle_if_needed(reinterpret_tensor_wrapper("
                )
                or not self.is_statically_known_list_of_ints(size)
                or not self.is_statically_known_list_of_ints(stride)
                or not (isinstance(offset, int) or getattr(offset, "is_Integer", False))
            ):
                return view
            keep = f"{data.get_name()}_view_{next(self.tmp_tensor_id)}"
            writeline(
                f"static thread_local RAIIAtenTensorHandle& {keep} = *new RAIIAtenTensorHandle();"
            )
            writeline(f"if (!{keep}.get()) {{ {NORMAL_TENSORS} {keep} = {view}; }}")
            return keep

        # ---------------------------------------------------- borrowed inputs

        def write_header(self) -> None:
            super().write_header()
            self.header.writeline("#include <c10/core/InferenceMode.h>")
            self.header.writeline(f"static thread_local bool {BORROWED_FLAG} = false;")

        def generate_return(self, output_refs: list[str]) -> None:
            super().generate_return(output_refs)
            # An input returned as an output is handed to the caller: not borrowable.
            self._borrowable = not V.graph.constants and not any(
                ref in V.graph.graph_inputs for ref in output_refs
            )
            names = [n for n, v in V.graph.graph_inputs.items() if isinstance(v, ir.IRNode)]
            releases = " ".join(f"{n}.release();" for n in names)
            self.wrapper_call.writeline(
                f"if ({BORROWED_FLAG}) {{ for (auto& h : inputs) h.release(); {releases} }}"
            )

        def generate_before_suffix(self, result: Any) -> None:
            super().generate_before_suffix(result)
            body = self.wrapper_call.getvalue()
            if V.graph.aot_mode or not self._borrowable or "std::move(arg" in body:
                return
            result.splice(_BORROWED_ENTRY)

        def make_buffer_reuse(self, old: Any, new: Any, delete_old: bool) -> str:
            # A reuse may carry data (an in-place kernel continues in the new buffer), so
            # the new name refers to the same memory. Never an output here (its chain is
            # kept per call); were it one, Inductor's move would take the memory out of
            # the thread's handle, and the next call would allocate afresh.
            old_name, new_name = old.get_name(), new.get_name()
            if old_name not in self._static or new_name in V.graph.get_output_names():
                return super().make_buffer_reuse(old, new, delete_old)
            if old.get_size() == new.get_size() and old.get_stride() == new.get_stride():
                self._static[new_name] = self._static[old_name]
                return f"RAIIAtenTensorHandle& {new_name} = {old_name};  // reuse"
            with self._declaring_from_views():
                return super().make_buffer_reuse(old, new, delete_old)

        def codegen_deferred_allocation(self, name: str, view: Any) -> None:
            with self._declaring_from_views():
                super().codegen_deferred_allocation(name, view)

        @contextlib.contextmanager
        def _declaring_from_views(self) -> Iterator[None]:
            self._plain_views = True
            try:
                yield
            finally:
                self._plain_views = False

    def _drop_input(name: str) -> str:
        """An input's early free: given back to a caller that lends its handles."""
        return f"if ({BORROWED_FLAG}) {name}.release(); else {name}.reset();"

    def _reaching_outputs(lines: list[Any]) -> set[str]:
        """Every buffer whose memory ends up in a graph output: the outputs, the buffers
        an output views (a non-owning layout), and, transitively, those a buffer of
        these reuses."""
        from torch._inductor.codegen.wrapper import ReuseLine

        reused_from = {
            line.reused_as.get_name(): line.node.get_name()
            for line in lines
            if isinstance(line, ReuseLine)
        }
        names = set(V.graph.get_output_names())
        todo = list(names)
        while todo:
            name = todo.pop()
            found = [reused_from.get(name)]
            buffer = V.graph.name_to_buffer.get(name)
            layout = getattr(buffer, "layout", None)
            if isinstance(layout, ir.NonOwningLayout):
                found.append(layout.view.get_name())
            for other in found:
                if other is not None and other not in names:
                    names.add(other)
                    todo.append(other)
        return names

    return StaticBuffersWrapper


def _version_pass() -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class StaticBuffersVersion(CustomGraphPass):
        """Changes nothing; its uuid keeps static-buffer modules apart in the cache."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return VERSION

    return StaticBuffersVersion()


@contextlib.contextmanager
def static_buffers(active: bool = True) -> Iterator[None]:
    """While active, CPU graphs compile with the static-buffer wrapper, under the version
    pass. Nothing changes where `active` is false or this Inductor lacks the hooks."""
    wrapper = _wrapper_class() if active else None
    if wrapper is None:
        yield
        return
    import torch._inductor.config as inductor_config
    from torch._inductor.codegen import common

    common.init_backend_registration()
    cpu = common.device_codegens.get("cpu")
    if cpu is None or not dataclasses.is_dataclass(cpu):
        yield
        return
    codegens = common.device_codegens
    codegens["cpu"] = dataclasses.replace(cpu, cpp_wrapper_codegen=wrapper)
    try:
        with inductor_config.patch(post_grad_custom_post_pass=_version_pass()):
            yield
    finally:
        codegens["cpu"] = cpu
