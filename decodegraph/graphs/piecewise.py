"""Piecewise graphs: capture the pieces between attention calls, run attention eagerly.

The model forward is traced once per capture size (make_fx, no compiler front end)
and split at every `decodegraph::unified_attention` call. A decoder of L layers gives
L attention calls and L + 1 pieces; each piece becomes a graph, attention runs
eagerly between them with this step's metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.fx.passes.split_module import split_module

import decodegraph.attention.layer  # noqa: F401  (registers the attention op)
from decodegraph.graphs.graph import Graph, GraphFn, compile_with_inductor, trace

ATTENTION_OP = torch.ops.decodegraph.unified_attention.default


def split_at_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
    """Split a traced forward at attention calls; return it and its piece names."""
    partition = 0
    assignment: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is ATTENTION_OP:
            partition += 1
            assignment[node] = partition
            partition += 1
        elif node.op not in ("placeholder", "output"):
            assignment[node] = partition
    split = split_module(gm, None, lambda node: assignment[node], keep_original_order=True)
    attention_parts = {f"submod_{p}" for n, p in assignment.items() if n.target is ATTENTION_OP}
    pieces = [
        name
        for name, _ in split.named_children()
        if name.startswith("submod_") and name not in attention_parts
    ]
    return split, pieces


class _PieceRecorder(torch.fx.Interpreter):
    """Runs the split forward once, recording each piece's real arguments."""

    def __init__(self, module: torch.fx.GraphModule, pieces: set[str]) -> None:
        super().__init__(module)
        self.pieces = pieces
        self.args: dict[str, tuple] = {}

    def call_module(self, target: str, args: tuple, kwargs: dict) -> object:
        if target in self.pieces:
            self.args[target] = args
        return super().call_module(target, args, kwargs)


class CudaPiece(torch.nn.Module):
    """One piece as a CUDA graph. Inputs that are not at a stable address (attention
    outputs) are copied into static buffers before each replay."""

    def __init__(
        self,
        piece: torch.fx.GraphModule,
        args: Sequence[torch.Tensor],
        stable: set[int],
        pool: object,
        num_warmups: int,
    ) -> None:
        super().__init__()
        self._static = [a if a.data_ptr() in stable else a.clone() for a in args]
        with torch.no_grad():
            for _ in range(num_warmups):
                piece(*self._static)
            torch.cuda.synchronize()
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph, pool=pool):
                out = piece(*self._static)
        self._outputs = out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            stable.add(t.data_ptr())

    def forward(self, *args: torch.Tensor) -> object:
        for static, arg in zip(self._static, args, strict=True):
            if static.data_ptr() != arg.data_ptr():
                static.copy_(arg)
        self._graph.replay()
        return self._outputs


class PiecewiseGraph(Graph):
    """A split forward whose pieces are graphs; attention runs eagerly."""

    def __init__(
        self,
        name: str,
        fn: GraphFn,
        inputs: Sequence[torch.Tensor],
        make_piece: Callable[[torch.fx.GraphModule, tuple], Callable[..., object]],
    ) -> None:
        super().__init__(name, inputs)
        self.split, self.piece_names = split_at_attention(trace(fn, inputs))
        recorder = _PieceRecorder(self.split, set(self.piece_names))
        with torch.no_grad():
            recorder.run(*inputs)
            for piece_name in self.piece_names:
                piece = getattr(self.split, piece_name)
                setattr(self.split, piece_name, make_piece(piece, recorder.args[piece_name]))

    @property
    def num_pieces(self) -> int:
        return len(self.piece_names)

    def _run(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        out = self.split(*inputs)
        return out[0] if isinstance(out, (list, tuple)) else out


class _CompiledPiece(torch.nn.Module):
    def __init__(self, compiled: Callable[..., object]) -> None:
        super().__init__()
        self._compiled = compiled

    def forward(self, *args: torch.Tensor) -> object:
        return self._compiled(*args)


def cpu_piece_factory(
    use_inductor: bool, inductor_options: dict[str, object] | None = None
) -> Callable[[torch.fx.GraphModule, tuple], object]:
    """Pieces for CPU: Inductor-compiled, or the traced piece replayed as is."""

    def make(piece: torch.fx.GraphModule, args: tuple) -> object:
        if not use_inductor:
            return piece
        return _CompiledPiece(compile_with_inductor(piece, args, inductor_options))

    return make
