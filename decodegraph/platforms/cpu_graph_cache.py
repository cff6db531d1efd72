"""An index from a traced CPU graph to the Inductor module compiled for it.

A warm start (Inductor's cache directory already filled) still re-ran most of the
compile for every graph: AOTAutograd's second trace of the whole model, fake inputs for
every weight and Inductor's own cache key, only to load the module the cold start wrote.
This index keys each compiled module by the traced graph itself (its code, every node's
shape, dtype and strides, every input's layout), the Inductor options and config, and the
torch build, and records which module Inductor wrote for it; a later process that traces
the same graph loads that module directly. The trace still runs in every process, so a
change to the model, an operator or a buffer's shape changes the key and compiles
afresh: nothing here trusts a cached result for a graph it has not traced.

Entries live beside Inductor's own cache (`TORCHINDUCTOR_CACHE_DIR`); an entry whose
module is gone, or that cannot be read, is a miss. Only a graph whose Inductor function
was called directly and matched AOTAutograd's wrapper at its cold compile is entered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

# Bump when what an entry holds or how the key is made changes.
_VERSION = 2
_DIR_NAME = "decodegraph_graphs"


def graph_key(
    gm: torch.fx.GraphModule,
    node_meta: Sequence[object],
    args: Sequence[torch.Tensor],
    options: dict[str, object],
    static_buffers: str = "",
) -> str:
    """The key of a traced graph whose tensor attributes are already placeholders.

    `node_meta` is each node's value metadata from the trace (see `node_metadata`),
    taken before compile_with_inductor strips it."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    with inductor_config.patch(options):
        inductor = _portable(inductor_config)
        isa = pick_vec_isa()  # what the kernels were generated and built for
    functorch = _portable(functorch_config)
    parts = [
        f"v{_VERSION}",
        # The static-buffer wrapper's version (inductor_static.VERSION), or "" for plain.
        f"static buffers {static_buffers}",
        torch.__version__,
        str(torch.version.git_version),
        torch.backends.cpu.get_cpu_capability(),
        f"{isa} {isa.build_arch_flags() if isa else ''}",
        # Inductor writes the intra-op thread count into its kernels' parallel loops.
        str(torch.get_num_threads()),
        str(torch.get_default_dtype()),
        str(torch.are_deterministic_algorithms_enabled()),
        repr(sorted(inductor.items(), key=lambda kv: kv[0])),
        repr(sorted(functorch.items(), key=lambda kv: kv[0])),
        gm.code,
        repr(list(node_meta)),
        repr([_tensor_layout(a) for a in args]),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _portable(config: object) -> dict[str, object]:
    """A config module's settings, its private ones included where torch can say them."""
    try:
        return config.save_config_portable(ignore_private_configs=False)
    except TypeError:  # an older torch: public settings only
        return config.save_config_portable()


def node_metadata(gm: torch.fx.GraphModule) -> list[object]:
    """Each node's traced value as (shape, stride, dtype), or its repr for non-tensors."""
    meta: list[object] = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        values = val if isinstance(val, (list, tuple)) else (val,)
        meta.append(
            [
                (tuple(v.shape), tuple(v.stride()), str(v.dtype))
                if isinstance(v, torch.Tensor)
                else repr(v)
                for v in values
            ]
        )
    return meta


def _tensor_layout(t: torch.Tensor) -> tuple[object, ...]:
    # Not the storage offset: compiled code indexes an input from its data pointer
    # (Inductor's own key drops it too), and a KV cache's offset in its mapping differs
    # from process to process.
    return (
        tuple(t.shape),
        t.stride(),
        str(t.dtype),
        str(t.device),
        t.requires_grad,
        t.is_inference(),
    )


def _entry_path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), _DIR_NAME, f"{key}.json")


class Entry(NamedTuple):
    """What the index holds for a graph: its module's compiled function (Inductor's
    `call`, taking one flat list of inputs), and whether that module's C++ entry,
    bound to inputs of the graph's layout, gave the plain call's outputs (checked once,
    in the process that entered it: the same module over the same layouts binds the
    same way)."""

    call: Callable[[list], list]
    bind_checked: bool


def load(key: str, options: dict[str, object]) -> Entry | None:
    """The entry under `key`, or None. Loads under `options`, so that the module finds
    the C++ library it was built with instead of building another."""
    path = _entry_path(key)
    try:
        with open(path) as f:
            entry = json.load(f)
        module_key = entry["module_key"]
        bind_checked = bool(entry.get("bind_checked", False))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    import torch._inductor.config as inductor_config
    from torch._inductor.codecache import PyCodeCache, get_path

    module_path = get_path(module_key, "py")[2]
    if not os.path.exists(module_path):
        return None
    try:
        with inductor_config.patch(options):
            module = PyCodeCache.load_by_key_path(module_key, module_path)
    except Exception as e:  # a broken entry is a miss, never a failed start-up
        logger.warning("ignoring compiled-graph entry %s: %s", path, e)
        return None
    call = getattr(module, "call", None)
    return Entry(call, bind_checked) if callable(call) else None


def save(key: str, module_key: str, bind_checked: bool = False) -> None:
    """Enter the Inductor module `module_key` (PyCodeCache's key) under `key`; with
    `bind_checked`, its bound C++ entry gave the plain call's outputs."""
    from torch._inductor.codecache import write_atomic

    entry = {"module_key": module_key, "bind_checked": bind_checked}
    try:
        write_atomic(_entry_path(key), json.dumps(entry), make_dirs=True)
    except OSError as e:
        logger.debug("could not write compiled-graph entry: %s", e)


def mark_bind_checked(key: str) -> None:
    """Record in `key`'s entry that its bound C++ entry passed its check."""
    try:
        with open(_entry_path(key)) as f:
            module_key = json.load(f)["module_key"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    save(key, module_key, bind_checked=True)
