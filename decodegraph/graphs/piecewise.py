"""Piecewise graphs: the pieces between attention calls are graphs, attention runs eagerly.

The model forward is traced once per capture size (make_fx, no compiler front end) and
split at every `unified_attention_with_output` call (attention/layer.py). A decoder of
L layers gives L attention calls and L + 1 pieces; the platform makes each piece a
graph (`Platform.make_piece`), and attention runs eagerly between them with this step's
metadata.

No piece ever takes a copy of a weight. `split_module` hands every tensor the trace
read as a constant (weights, rotary tables) to the pieces as arguments;
`split_at_attention` turns those back into attributes of the piece, the model's own
tensors. What remains as a piece's arguments are the graph's inputs (the persistent
buffers) and earlier pieces' outputs, among them the buffer each attention call writes
its output into, allocated by the piece before it: on a device, all at fixed addresses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.fx.passes.split_module import split_module

from decodegraph.attention.layer import SPLIT_OP
from decodegraph.platforms.base import DeviceGraph, GraphFn, Platform, trace

if TYPE_CHECKING:
    from decodegraph.config import CompilationConfig


def split_at_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
    """Split a traced forward at attention calls; return it and its piece names (in
    the order they run)."""
    partition = 0
    assignment: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is SPLIT_OP:
            partition += 1
            assignment[node] = partition
            partition += 1
        elif node.op not in ("placeholder", "output"):
            assignment[node] = partition
    split = split_module(gm, None, lambda node: assignment[node], keep_original_order=True)
    attention_parts = {f"submod_{p}" for n, p in assignment.items() if n.target is SPLIT_OP}
    pieces = [
        name
        for name, _ in split.named_children()
        if name.startswith("submod_") and name not in attention_parts
    ]
    _keep_constants_in_pieces(split)
    return split, pieces


def _keep_constants_in_pieces(split: torch.fx.GraphModule) -> None:
    """Make every tensor attribute that split_module passes to a submodule as an
    argument an attribute of that submodule again (the same tensor)."""
    for call in split.graph.nodes:
        if call.op != "call_module":
            continue
        piece = split.get_submodule(call.target)
        placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
        kept_args = []
        for arg, placeholder in zip(call.args, placeholders, strict=True):
            if not (isinstance(arg, torch.fx.Node) and arg.op == "get_attr"):
                kept_args.append(arg)
                continue
            name = f"_const_{placeholder.name}"
            value = _fetch(split, arg)
            if isinstance(value, torch.nn.Parameter):
                piece.register_parameter(name, value)
            else:
                piece.register_buffer(name, value, persistent=False)
            with piece.graph.inserting_before(placeholder):
                attr = piece.graph.get_attr(name)
            placeholder.replace_all_uses_with(attr)
            piece.graph.erase_node(placeholder)
        call.args = tuple(kept_args)
        piece.recompile()
    for node in list(split.graph.nodes):
        if node.op == "get_attr" and not node.users:
            split.graph.erase_node(node)
    split.recompile()


def _fetch(module: torch.nn.Module, node: torch.fx.Node) -> Any:
    owner, _, name = node.target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)


class _PieceMaker(torch.fx.Interpreter):
    """Runs the split forward once, making each piece a graph when it is reached: its
    arguments are then what the pieces made before it returned (on a device, their
    static outputs)."""

    def __init__(
        self,
        split: torch.fx.GraphModule,
        pieces: Sequence[str],
        make: Any,
    ) -> None:
        super().__init__(split)
        self.pieces = set(pieces)
        self.make = make

    def call_module(self, target: str, args: tuple, kwargs: dict) -> object:
        if target not in self.pieces:
            return super().call_module(target, args, kwargs)
        piece = self.make(target, self.fetch_attr(target), args)
        # A plain attribute, not a child module: no nn.Module call overhead per replay.
        delattr(self.module, target)
        setattr(self.module, target, piece)
        return piece(*args)


class PiecewiseGraph(DeviceGraph):
    """A split forward whose pieces are the platform's graphs; attention runs eagerly.
    Like any graph it binds its inputs at capture; replay takes none."""

    def __init__(
        self,
        name: str,
        fn: GraphFn,
        inputs: Sequence[torch.Tensor],
        platform: Platform,
        config: CompilationConfig,
    ) -> None:
        super().__init__(name, inputs)
        traced = trace(fn, inputs, platform.graph_decompositions())
        self.split, self.piece_names = split_at_attention(traced)
        stable = {t.data_ptr() for t in self.inputs}

        def make(piece_name: str, piece: torch.fx.GraphModule, args: tuple) -> object:
            return platform.make_piece(f"{name}.{piece_name}", piece, args, stable, config)

        with torch.no_grad():
            _PieceMaker(self.split, self.piece_names, make).run(*self.inputs)

    @property
    def num_pieces(self) -> int:
        return len(self.piece_names)

    def _run(self) -> Any:
        out = self.split(*self.inputs)
        return out[0] if isinstance(out, (list, tuple)) else out
