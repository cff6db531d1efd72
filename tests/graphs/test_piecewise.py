"""Piecewise graphs: the split at attention, pieces as the platform's graphs, and no
weight ever passed to or copied into a piece (CPU pieces and device-like pieces)."""

from __future__ import annotations

import pytest
import torch

import decodegraph.attention.layer  # noqa: F401  (registers the attention ops)
from decodegraph.attention.backends.base import AttentionMetadata
from decodegraph.attention.backends.torch_paged import CPUAttentionBackend
from decodegraph.attention.layer import SPLIT_OP
from decodegraph.config import CompilationConfig
from decodegraph.forward_context import EAGER_PARAMS_ID, ForwardContext, set_forward_context
from decodegraph.graphs.piecewise import PiecewiseGraph, split_at_attention
from decodegraph.platforms.base import InputAddressError, Platform, trace
from decodegraph.platforms.cpu import CpuPlatform
from tests.utils.platforms import StaticGraphPlatform

NO_INDUCTOR = CompilationConfig(use_inductor=False)
WITH_INDUCTOR = CompilationConfig(use_inductor=True)


def _attention_setup(n: int) -> CPUAttentionBackend:
    """A real backend whose eager params hold one prefill of n tokens."""
    backend = CPUAttentionBackend(2, 1, 4, 0.5, 4, 16)
    shape = backend.get_kv_cache_shape(6, 4, 1, 4)
    backend.bind_kv_caches([(torch.zeros(shape), torch.zeros(shape)) for _ in range(3)])
    backend.allocate_workspace(1, torch.float32, torch.device("cpu"))
    backend.set_eager_metadata(
        AttentionMetadata(
            num_reqs=1,
            num_actual_tokens=n,
            max_query_len=n,
            max_seq_len=n,
            uniform_decode=False,
            query_start_loc_cpu=[0, n],
            seq_lens_cpu=[n],
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            block_tables=torch.tensor([[1, 2, 3, 4]], dtype=torch.int32),
            slot_mapping=torch.arange(4, 4 + n),
        )
    )
    return backend


class ThreeLayers(torch.nn.Module):
    """Three 'layers', each a projection and an attention call, sharing a table (like
    the rotary cos/sin every layer reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(8, 8), requires_grad=False) for _ in range(3)
        )
        self.register_buffer("table", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in range(3):
            h = x @ self.w[layer] + self.table
            out = h.new_empty((h.shape[0], 8))
            torch.ops.decodegraph.unified_attention_with_output(
                h, h[:, :4], h[:, 4:], out, layer, EAGER_PARAMS_ID
            )
            x = x + out
        return (x * self.table).tanh()


def _weights(model: torch.nn.Module) -> set[int]:
    return {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}


def _piecewise(platform: Platform, config: CompilationConfig, model: ThreeLayers, x: torch.Tensor):
    backend = _attention_setup(x.shape[0])
    context = ForwardContext(backend, EAGER_PARAMS_ID, split_attention=True)
    with set_forward_context(context):
        graph = PiecewiseGraph("pw", model, [x], platform, config)
    return graph, context


PLATFORMS = [
    pytest.param(CpuPlatform, NO_INDUCTOR, id="cpu-trace"),
    pytest.param(CpuPlatform, WITH_INDUCTOR, id="cpu-inductor"),
    pytest.param(StaticGraphPlatform, NO_INDUCTOR, id="device-like"),
]


@pytest.mark.parametrize("platform_cls, config", PLATFORMS)
def test_layers_plus_one_pieces_replay_exactly_over_the_bound_input(
    platform_cls: type[Platform], config: CompilationConfig
) -> None:
    model, x = ThreeLayers(), torch.randn(5, 8)
    graph, context = _piecewise(platform_cls(), config, model, x)
    assert graph.num_pieces == 4
    with set_forward_context(context):
        torch.testing.assert_close(graph.replay(), model(x))
        x.copy_(torch.randn(5, 8))  # the step writes the bound buffer; replay takes nothing
        torch.testing.assert_close(graph.replay(), model(x))


def test_split_at_attention_keeps_every_attention_call_outside_the_pieces() -> None:
    model, x = ThreeLayers(), torch.randn(5, 8)
    with set_forward_context(ForwardContext(_attention_setup(5), EAGER_PARAMS_ID)):
        split, pieces = split_at_attention(trace(model, [x]))
    assert len(pieces) == 4
    for name in pieces:
        targets = [n.target for n in getattr(split, name).graph.nodes]
        assert SPLIT_OP not in targets, f"{name} holds an attention call"


def test_pieces_hold_the_weights_themselves_and_take_none_as_arguments() -> None:
    """split_module passes every constant to the pieces as an argument; the split hands
    them back as attributes of the piece: the model's own tensors, not copies."""
    model, x = ThreeLayers(), torch.randn(5, 8)
    weights = _weights(model)
    with set_forward_context(ForwardContext(_attention_setup(5), EAGER_PARAMS_ID)):
        split, pieces = split_at_attention(trace(model, [x]))
    held = set()
    for call in split.graph.nodes:
        if call.op == "call_module":
            assert all(a.op != "get_attr" for a in call.args), f"{call.target} takes a constant"
    for name in pieces:
        piece = getattr(split, name)
        for node in piece.graph.nodes:
            if node.op == "get_attr":
                held.add(getattr(piece, node.target).data_ptr())
    assert held == weights  # every weight and the shared table, each the original


@pytest.mark.parametrize("platform_cls, config", PLATFORMS)
def test_a_weight_changed_in_place_is_read_by_the_next_replay(
    platform_cls: type[Platform], config: CompilationConfig
) -> None:
    """No piece holds a copy of a weight (a copy would keep the old values)."""
    model, x = ThreeLayers(), torch.randn(5, 8)
    graph, context = _piecewise(platform_cls(), config, model, x)
    with torch.no_grad():
        for w in model.w:
            w.mul_(-2)
        model.table.add_(1)
    with set_forward_context(context):
        torch.testing.assert_close(graph.replay(), model(x))


def test_device_like_pieces_take_only_stable_arguments_and_copy_nothing() -> None:
    """On a device platform every piece argument is a bound input or an earlier piece's
    static output (the attention outputs included: they live in the piece before);
    the pieces' graphs bind exactly those tensors, and no weight."""
    platform, model, x = StaticGraphPlatform(), ThreeLayers(), torch.randn(5, 8)
    graph, context = _piecewise(platform, NO_INDUCTOR, model, x)
    weights = _weights(model)
    assert len(platform.graphs_made) == 4
    for piece_graph in platform.graphs_made:
        assert not {t.data_ptr() for t in piece_graph.inputs} & weights
    with set_forward_context(context):
        first = graph.replay()
        assert graph.replay() is first  # static outputs, like a device graph's


def test_a_device_piece_refuses_an_argument_at_no_stable_address() -> None:
    piece = torch.fx.symbolic_trace(lambda a: a * 2)
    with pytest.raises(InputAddressError, match="arguments \\[0\\]"):
        StaticGraphPlatform().make_piece("p", piece, [torch.ones(2)], set(), NO_INDUCTOR)
