"""The one place that decides, per step, which runtime mode runs and under which key."""

from __future__ import annotations

import bisect
from typing import NamedTuple

from decodegraph.forward_context import BatchDescriptor
from decodegraph.graphs.modes import CUDAGraphMode, RuntimeMode


class StepPlan(NamedTuple):
    """A step's runtime mode and padded key, as the driver's dispatcher decided them.

    Under tensor parallelism it travels with the step to every rank, so that all ranks
    replay the same graph, or all run eager (docs/design.md §8)."""

    mode: RuntimeMode
    key: BatchDescriptor


class StepPlanError(RuntimeError):
    """A rank's own graphs do not match the driver's plan for a step."""


class CudagraphDispatcher:
    """Maps a step's `BatchDescriptor` to (runtime mode, padded key).

    Full decode keys exist for every capture size when the resolved mode runs FULL
    for uniform decode; mixed keys (full or piecewise) exist for every capture size
    when it runs a graph for mixed batches. A batch larger than the largest capture
    size, or of a shape no key covers, runs eagerly (RuntimeMode.NONE, key unpadded);
    with `dynamic_decode`, a uniform decode batch above the largest decode size (up to
    max_num_reqs) runs FULL under its own unpadded key instead, which the graph runner's
    one dynamic decode graph serves (`dynamic_decode_rows`).

    Decode sizes whose graphs are made later, when a batch first needs them
    (`defer_decode_sizes`), pad no batch until `decode_size_made`: a batch meanwhile pads
    to the smallest larger size that is made, or runs eagerly.
    """

    def __init__(
        self,
        mode: CUDAGraphMode,
        capture_sizes: list[int],
        max_num_reqs: int | None = None,
        dynamic_decode: bool = False,
    ) -> None:
        self.mode = mode
        self.capture_sizes = sorted(capture_sizes) if mode is not CUDAGraphMode.NONE else []
        # A uniform decode batch has one token per request: no more than max_num_reqs.
        self.decode_sizes = [
            s for s in self.capture_sizes if max_num_reqs is None or s <= max_num_reqs
        ]
        # The decode sizes whose graphs are made (all but the deferred ones).
        self.made_decode_sizes = list(self.decode_sizes)
        self.keys: dict[RuntimeMode, list[BatchDescriptor]] = {
            RuntimeMode.FULL: [],
            RuntimeMode.PIECEWISE: [],
        }
        # FULL serves uniform decode with its mixed-batch graphs: one graph per size.
        self._uniform_full = (
            mode.decode_mode() is RuntimeMode.FULL and mode.mixed_mode() is not RuntimeMode.FULL
        )
        if self._uniform_full:
            for size in self.decode_sizes:
                self.keys[RuntimeMode.FULL].append(BatchDescriptor(size, size, True))
        # (fewest, most) rows of the uniform decode batches the dynamic graph runs: from
        # the largest decode size on (at least 2: a graph of symbolic rows assumes two or
        # more) to max_num_reqs; None where there is none.
        self.dynamic_decode_rows: tuple[int, int] | None = None
        if dynamic_decode and self._uniform_full and max_num_reqs is not None:
            fewest = max(self.decode_sizes[-1] + 1 if self.decode_sizes else 1, 2)
            if fewest <= max_num_reqs:
                self.dynamic_decode_rows = (fewest, max_num_reqs)
        if mode.mixed_mode() is not RuntimeMode.NONE:
            for size in self.capture_sizes:
                self.keys[mode.mixed_mode()].append(BatchDescriptor(size, None, False))

    @staticmethod
    def _pad(sizes: list[int], num_tokens: int) -> int | None:
        """The smallest size >= num_tokens, or None when none is."""
        i = bisect.bisect_left(sizes, num_tokens)
        return sizes[i] if i < len(sizes) else None

    def defer_decode_sizes(self, sizes: list[int]) -> None:
        """Decode sizes whose graphs are not made yet (each until `decode_size_made`)."""
        self.made_decode_sizes = [s for s in self.made_decode_sizes if s not in sizes]

    def decode_size_made(self, size: int) -> None:
        """A deferred decode size's graph is made: it pads batches from now on."""
        if size in self.decode_sizes and size not in self.made_decode_sizes:
            self.made_decode_sizes = sorted([*self.made_decode_sizes, size])

    def padded_decode_size(self, num_reqs: int) -> int | None:
        """The smallest decode size >= num_reqs whose graph is made, or None."""
        return self._pad(self.made_decode_sizes, num_reqs)

    def planned_decode_size(self, num_reqs: int) -> int | None:
        """The smallest decode capture size >= num_reqs, made or not, or None."""
        return self._pad(self.decode_sizes, num_reqs)

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest capture size >= num_tokens, or None when none is."""
        return self._pad(self.capture_sizes, num_tokens)

    def dispatch(self, desc: BatchDescriptor) -> StepPlan:
        """The runtime mode and key for one step's (unpadded) batch."""
        if desc.uniform and self._uniform_full:
            padded = self._pad(self.made_decode_sizes, desc.num_tokens)
            if padded is not None:
                return StepPlan(RuntimeMode.FULL, BatchDescriptor(padded, padded, True))
            if self.covers_dynamic(desc.num_tokens):
                n = desc.num_tokens
                return StepPlan(RuntimeMode.FULL, BatchDescriptor(n, n, True))
        mixed = self.mode.mixed_mode()
        padded = self.padded_size(desc.num_tokens)
        if mixed is RuntimeMode.NONE or padded is None:
            return StepPlan(RuntimeMode.NONE, desc)
        return StepPlan(mixed, BatchDescriptor(padded, None, False))

    def covers_dynamic(self, num_reqs: int) -> bool:
        """Whether a uniform decode batch of `num_reqs` runs the dynamic decode graph."""
        return in_rows(self.dynamic_decode_rows, num_reqs)

    def all_keys(self) -> list[tuple[RuntimeMode, BatchDescriptor]]:
        """Every (mode, key) to capture, largest first (later graphs reuse the pool)."""
        pairs = [(m, k) for m, ks in self.keys.items() for k in ks]
        return sorted(pairs, key=lambda p: (-p[1].num_tokens, p[0].value))


def in_rows(rows: tuple[int, int] | None, num_reqs: int) -> bool:
    """Whether `num_reqs` lies in the (fewest, most) range `rows` (None: no range)."""
    return rows is not None and rows[0] <= num_reqs <= rows[1]
