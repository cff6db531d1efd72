// A compiled CPU graph's C++ entry, called over inputs bound once (platforms/
// inductor_cpp.py's bound entries).
//
// Inductor's C++ wrapper module exposes `inductor_entry_impl(inputs, outputs)`: it takes
// ownership of one tensor handle per input and releases each as soon as the graph is done
// with it. Made from the Python tensors at every call (`unsafe_alloc_void_ptrs_from_tensors`),
// each handle is a reference to a tensor that Python owns: converting the list costs a
// pybind cast per tensor, and each release, made after the entry has let the GIL go, takes
// the GIL back to drop the Python reference. A graph's inputs are the same tensors at every
// replay (persistent buffers, weights), so a GraphEntry holds an alias of each, made once:
// a tensor of its own over the same memory (same storage, offset, sizes and strides) with
// no Python object, whose handles are plain reference counts. A replay reads whatever was
// written into that memory, as a device graph does; a tensor that later replaces an input
// is not seen (it was not seen before either: the graph runner checks the addresses).
// A module compiled with static buffers (platforms/inductor_static.py) also exports an
// entry that borrows the input handles rather than taking them: its handles are made once
// at bind and lent to every call, so a replay makes and frees no handle per input.
#ifndef DECODEGRAPH_GRAPH_ENTRY_H
#define DECODEGRAPH_GRAPH_ENTRY_H

#include <ATen/core/Tensor.h>
#include <Python.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#if __has_include(<torch/csrc/shim_exception_state.h>)
#include <torch/csrc/shim_exception_state.h>
#define DECODEGRAPH_SHIM_ERROR 1
#endif

// libtorch_python's tensor -> Python object (torch/csrc/autograd/python_variable.h, whose
// pybind11 includes would double this library's build time).
PyObject* THPVariable_Wrap(const at::TensorBase& var);

namespace decodegraph {

struct GraphEntry {
    using Impl = void (*)(AtenTensorHandle*, AtenTensorHandle*);
    Impl impl;
    std::vector<at::Tensor> inputs;  // aliases without Python objects
    int64_t num_outputs;
    // Whether `impl` is a static-buffer module's entry that borrows its input handles
    // (platforms/inductor_static.py): the handles below, made once and lent to every
    // call, instead of a handle made and freed per input per call.
    bool lends = false;
    std::vector<AtenTensorHandle> lent;

    ~GraphEntry() {
        for (AtenTensorHandle h : lent)
            delete reinterpret_cast<at::Tensor*>(h);
    }

    void lend() {
        lent.resize(inputs.size());
        for (size_t i = 0; i < inputs.size(); i++)
            lent[i] = reinterpret_cast<AtenTensorHandle>(new at::Tensor(inputs[i]));
    }
};

// A C++ wrapper's error in full. An operator called through its C shim that throws
// leaves the wrapper only an error code, and the wrapper throws "<call> API call failed
// at <file>, line <n>"; the shim stored the operator's own message for the thread, which
// is added here (as the wrapper gave it where this torch stores none).
inline std::string graph_error(const char* what) {
    std::string message(what);
#ifdef DECODEGRAPH_SHIM_ERROR
    namespace shim = torch::csrc::shim::details;
    const std::string& reason = shim::get_torch_exception_what_without_backtrace();
    if (message.find(" API call failed at ") != std::string::npos && !reason.empty())
        message += ": " + reason;
#endif
    return message;
}

// An alias of t: another tensor object over the same memory and layout.
inline at::Tensor alias_of(const at::Tensor& t) {
    at::Tensor a = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(t.storage()), t.key_set(), t.dtype());
    a.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(),
                                                   t.storage_offset());
    return a;
}

}  // namespace decodegraph

// Called by a bound entry's callable (decodegraph_graph_entry_bind, below) with the GIL
// held (the entry releases it while it runs): the graph's outputs as a list of tensors
// (None where the graph returns no tensor), or NULL with a Python RuntimeError set. The
// output array has room for kOutputSlack handles past num_outputs: an entry that writes there returned more than
// its graph was bound with, which is refused rather than written past the array.
constexpr size_t kOutputSlack = 16;

extern "C" inline PyObject* decodegraph_graph_entry_call(void* entry) {
    auto* e = static_cast<decodegraph::GraphEntry*>(entry);
    const size_t n = static_cast<size_t>(e->num_outputs);
    std::vector<AtenTensorHandle> out(n + kOutputSlack, nullptr);
    // The entry nulls the array it is given: a copy of the lent handles, or new ones that
    // it takes.
    std::vector<AtenTensorHandle> in = e->lent;
    if (!e->lends) {
        in.resize(e->inputs.size());
        for (size_t i = 0; i < in.size(); i++)
            in[i] = reinterpret_cast<AtenTensorHandle>(new at::Tensor(e->inputs[i]));
    }
    bool failed = true;
    try {
        e->impl(in.data(), out.data());
        failed = false;
    } catch (const std::exception& err) {
        PyErr_SetString(PyExc_RuntimeError, decodegraph::graph_error(err.what()).c_str());
    } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, "a compiled graph's entry failed");
    }
    if (failed) {
        if (e->lends) {
            // Unwinding freed the handles the entry still held: which of the lent ones
            // are gone is unknown, so none is freed or lent again; the next call lends
            // new ones.
            e->lent.clear();
            e->lend();
        }
        return nullptr;
    }
    std::vector<at::Tensor> tensors(out.size());
    bool extra = false;
    for (size_t i = 0; i < out.size(); i++) {
        if (out[i] == nullptr)
            continue;
        auto* t = reinterpret_cast<at::Tensor*>(out[i]);
        tensors[i] = std::move(*t);
        delete t;
        extra = extra || i >= n;
    }
    if (extra) {
        PyErr_SetString(PyExc_RuntimeError,
                        "a compiled graph's entry returned more outputs than it was bound with");
        return nullptr;
    }
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(n));
    for (size_t i = 0; i < n; i++) {
        PyObject* item = tensors[i].defined() ? THPVariable_Wrap(tensors[i]) : Py_NewRef(Py_None);
        PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
    }
    return list;
}

namespace decodegraph {
inline constexpr const char* kGraphEntryCapsule = "decodegraph.GraphEntry";

inline PyObject* bound_entry_call(PyObject* capsule, PyObject* /*unused*/) {
    void* e = PyCapsule_GetPointer(capsule, kGraphEntryCapsule);
    return e == nullptr ? nullptr : decodegraph_graph_entry_call(e);
}

inline PyMethodDef bound_entry_def = {"bound_graph_entry", bound_entry_call, METH_NOARGS,
                                      "A compiled graph's C++ entry over its bound inputs."};
}  // namespace decodegraph

// A Python callable of no arguments that calls the entry (a GraphEntry*, from
// graph_entry_make) and owns it: the entry is freed with the callable. A builtin function
// over a capsule, so that a replay's call costs what a C method's does rather than a
// ctypes call's. Called once per bind through a ctypes PYFUNCTYPE prototype (the GIL held);
// NULL with a Python error set where it cannot be made (the entry is freed then too).
extern "C" inline PyObject* decodegraph_graph_entry_bind(int64_t entry) {
    auto* e = reinterpret_cast<decodegraph::GraphEntry*>(entry);
    PyObject* capsule = PyCapsule_New(e, decodegraph::kGraphEntryCapsule, [](PyObject* c) {
        delete static_cast<decodegraph::GraphEntry*>(
            PyCapsule_GetPointer(c, decodegraph::kGraphEntryCapsule));
    });
    if (capsule == nullptr) {
        delete e;
        return nullptr;
    }
    PyObject* fn = PyCFunction_New(&decodegraph::bound_entry_def, capsule);
    Py_DECREF(capsule);  // the function holds it, or it is freed with the entry
    return fn;
}
#endif
