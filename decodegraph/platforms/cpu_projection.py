"""How the CPU's batch-1 projection reads a loaded model's weights, measured.

`linear_one_row` (csrc/linear.h) reads a thread's float32 or bfloat16 weight rows either
as one stream, fetched ahead in software, or several rows at a time, far apart, left to
the hardware prefetcher. Every row is summed in the same order either way, so the bits are
the same; the time is not, and which order is the faster depends on the machine (two
AMD Zen 4 VMs disagreed; an Intel Xeon preferred each for some row lengths:
docs/performance.md). So once per process, after loading, the CPU platform times both
orders over the model's own projection weights and keeps the faster one for every row
length. Weights that fit the caches are not measured (a step reads them from there, and
the vendor rule stays); DECODEGRAPH_CPU_ROWS_SIDE_BY_SIDE=0 or 1 decides instead of any
measurement.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path

import torch

from decodegraph import native

logger = logging.getLogger(__name__)

ENV = "DECODEGRAPH_CPU_ROWS_SIDE_BY_SIDE"
# Measured only where the projection's weights are at least this many times the
# last-level cache: a step then streams them from memory.
CACHE_MULTIPLE = 2
# Without a last-level cache size from sysfs.
DEFAULT_LLC_BYTES = 32 << 20
# A timed pass reads the first of the weights, in the model's order, up to the larger of
# this and CACHE_MULTIPLE times the cache (a fraction of a second for both orders' passes).
PASS_BYTES = 256 << 20
# Timed passes per order, alternating, after one untimed pass each.
ROUNDS = 5
# An order faster by less than this share leaves the vendor rule as it is.
MARGIN = 0.03

ONE_STREAM, SIDE_BY_SIDE, VENDOR_RULE = 0, 1, -1


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 (Linux sysfs), else DEFAULT_LLC_BYTES."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text and text[-1] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=DEFAULT_LLC_BYTES)


def projection_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights a batch-1 step reads through linear_one_row, each once: those
    of the modules whose `one_row` is set (ReplicatedLinear's, once loaded) in the
    model's order, then the LM head of a model whose `logits_one_row` is set."""
    layers: dict[int, torch.Tensor] = {}
    heads: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if getattr(module, "one_row", None) is not None:
            layers.setdefault(id(module.weight), module.weight)
        if getattr(module, "logits_one_row", None) is not None:
            heads.setdefault(id(module.lm_head.weight), module.lm_head.weight)
    weights = [*layers.values(), *(w for key, w in heads.items() if key not in layers)]
    return [w for w in weights if w.dtype in (torch.float32, torch.bfloat16)]


def first_bytes(weights: list[torch.Tensor], budget: int) -> list[torch.Tensor]:
    """The weights in order up to `budget` bytes, the last one cut to its first rows."""
    taken, left = [], budget
    for w in weights:
        if left <= 0:
            break
        rows = min(w.shape[0], -(-left // w[0].nbytes))
        taken.append(w[:rows])
        left -= taken[-1].nbytes
    return taken


def time_pass(ops: object, weights: list[torch.Tensor], inputs: dict[tuple, torch.Tensor]) -> float:
    """Seconds for one batch-1 product with each weight in turn (`inputs`: an x for each
    row length and dtype)."""
    start = time.perf_counter()
    for w in weights:
        ops.linear_one_row(inputs[w.shape[1], w.dtype], w, None)
    return time.perf_counter() - start


def choose_projection_rows(model: torch.nn.Module) -> int | None:
    """Time both row orders over `model`'s projection weights and set the faster one for
    this process (VENDOR_RULE where neither is faster by MARGIN); return the setting, or
    None where nothing was measured (the environment decides, no operators, or the
    weights fit the caches)."""
    if os.environ.get(ENV) in ("0", "1"):
        return None
    ops = native.load_cpu_ops()
    weights = projection_weights(model)
    total = sum(w.nbytes for w in weights)
    llc = last_level_cache_bytes()
    if ops is None or total < CACHE_MULTIPLE * llc:
        return None
    timed = first_bytes(weights, max(PASS_BYTES, CACHE_MULTIPLE * llc))
    nbytes = sum(w.nbytes for w in timed)
    inputs = {(w.shape[1], w.dtype): torch.zeros(1, w.shape[1], dtype=w.dtype) for w in timed}
    seconds: dict[int, list[float]] = {ONE_STREAM: [], SIDE_BY_SIDE: []}
    orders = (ONE_STREAM, SIDE_BY_SIDE)
    with torch.inference_mode():
        for order in orders:  # untimed: first touches, the thread pool
            ops.set_rows_side_by_side(order)
            time_pass(ops, timed, inputs)
        for r in range(ROUNDS):
            for order in orders if r % 2 == 0 else orders[::-1]:
                ops.set_rows_side_by_side(order)
                seconds[order].append(time_pass(ops, timed, inputs))
    one, side = (statistics.median(seconds[o]) for o in orders)
    if side < one * (1 - MARGIN):
        choice = SIDE_BY_SIDE
    elif one < side * (1 - MARGIN):
        choice = ONE_STREAM
    else:
        choice = VENDOR_RULE
    ops.set_rows_side_by_side(choice)
    names = {ONE_STREAM: "one stream", SIDE_BY_SIDE: "rows side by side"}
    logger.info(
        "batch-1 projection over %d MiB of %s weights: one stream %.1f GB/s, rows side "
        "by side %.1f GB/s; reading them %s (%s=0/1 decides instead)",
        nbytes >> 20,
        "/".join(sorted({str(w.dtype).removeprefix("torch.") for w in timed})),
        nbytes / one / 1e9,
        nbytes / side / 1e9,
        names.get(choice, "by the vendor rule (neither was faster)"),
        ENV,
    )
    return choice
