"""Graphs and the graph manager: capture, replay, address checks, capture closing; and the
graph contracts the model runner keeps on a real engine (stories260K): padded rows write no
KV, `update_graph_params` is needed, capture uses dummy lengths, workspaces stay put."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from decodegraph.attention.backends.base import EAGER_SLOT, AttentionMetadata
from decodegraph.attention.backends.torch_paged import CPUAttentionBackend
from decodegraph.attention.forward_context import ForwardContext, set_forward_context
from decodegraph.config import CompilationConfig
from decodegraph.entrypoints.llm import LLM
from decodegraph.graphs.dispatcher import BatchDescriptor
from decodegraph.graphs.graph import CpuGraph, InputAddressError
from decodegraph.graphs.manager import CaptureClosedError, GraphManager
from decodegraph.graphs.modes import RuntimeMode
from decodegraph.graphs.piecewise import PiecewiseGraph, cpu_piece_factory, split_at_attention
from decodegraph.sampling_params import SamplingParams
from decodegraph.worker.input_buffers import PersistentBuffer
from tests.utils.kv import changed_slots

NO_INDUCTOR = CompilationConfig(use_inductor=False)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _affine(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) + 1


# ---------------------------------------------------------------- CPU graphs


def test_cpu_graph_replays_the_traced_ops_over_new_input_values() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph = CpuGraph("g", _affine, [x, w], use_inductor=False)
    x.copy_(torch.randn(4, 8))  # in place: same address, new values
    torch.testing.assert_close(graph.replay([x, w]), _affine(x, w))
    assert graph.num_replays == 1


def test_cpu_graph_replay_runs_none_of_the_python_and_keeps_baked_host_values() -> None:
    calls, scale = [], [2.0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * scale[0]  # a host value, baked at capture like a device graph does

    x = torch.ones(3)
    graph = CpuGraph("g", fn, [x], use_inductor=False)
    traced_calls = len(calls)
    scale[0] = 5.0
    out = graph.replay([x])
    assert len(calls) == traced_calls, "replay ran the captured function's Python"
    torch.testing.assert_close(out, torch.full((3,), 2.0))


def test_a_changed_input_address_is_caught_on_first_replay() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph = CpuGraph("decode(4)", _affine, [x, w], use_inductor=False)
    with pytest.raises(InputAddressError, match=r"decode\(4\).*\[1\]"):
        graph.replay([x, w.clone()])
    assert graph.num_replays == 0


def test_a_view_of_another_shape_at_the_same_address_is_caught() -> None:
    buf, w = torch.randn(8, 8), torch.randn(8, 8)
    graph = CpuGraph("g", _affine, [buf[:4], w], use_inductor=False)
    with pytest.raises(InputAddressError, match=r"inputs \[0\] do not have their capture"):
        graph.replay([buf[:6], w])


def test_a_view_at_another_offset_is_a_changed_address() -> None:
    buf = torch.randn(16, 8)
    w = torch.randn(8, 8)
    graph = CpuGraph("g", _affine, [buf[:4], w], use_inductor=False)
    with pytest.raises(InputAddressError):
        graph.replay([buf[4:8], w])
    torch.testing.assert_close(graph.replay([buf[:4], w]), _affine(buf[:4], w))


# ---------------------------------------------------------------- manager


class _Tied(torch.nn.Module):
    """One weight read twice (like tied embeddings) beside a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.register_buffer("b", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w + self.b) @ self.w.t()


def test_an_inductor_graph_takes_its_weights_as_inputs_and_is_called_directly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, x = _Tied(), torch.randn(4, 8)
    with caplog.at_level("DEBUG", logger="decodegraph.graphs.graph"):
        graph = CpuGraph("g", model, [x], use_inductor=True)
    assert "calling Inductor's function directly" in caplog.text
    x.copy_(torch.randn(4, 8))
    torch.testing.assert_close(graph.replay([x]), model(x))
    model.w.mul_(2)  # a weight changed in place is read at replay, not baked in
    torch.testing.assert_close(graph.replay([x]), model(x))


def test_an_inductor_argmax_picks_the_first_maximum_like_the_sampler() -> None:
    """Full decode graphs return argmax ids that stand in for the sampler's greedy()."""
    from decodegraph.sample.sampler import greedy

    logits = torch.randint(0, 4, (6, 40)).float()  # many tied maxima per row
    graph = CpuGraph("g", lambda x: (x * 1, x.argmax(dim=-1)), [logits], use_inductor=True)
    _, ids = graph.replay([logits])
    assert torch.equal(ids, greedy(logits))


def test_manager_counts_captures_and_closes_capture() -> None:
    manager = GraphManager("cpu", NO_INDUCTOR)
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    keys = [(RuntimeMode.FULL, BatchDescriptor(2, 2, True))]
    stats = manager.capture_all(
        keys, lambda m, k: manager.capture(m, k, _affine, [x, w]), lambda: 0
    )
    assert manager.closed
    assert stats.num_graphs == 1 and stats.by_mode == {"FULL": 1}
    assert stats.seconds > 0
    torch.testing.assert_close(manager.replay(*keys[0], [x, w]), _affine(x, w))
    with pytest.raises(CaptureClosedError):
        manager.capture(RuntimeMode.FULL, BatchDescriptor(1, 1, True), _affine, [x, w])


def test_manager_freezes_the_garbage_collector_during_capture_only() -> None:
    manager = GraphManager("cpu", NO_INDUCTOR)
    frozen: list[int] = []
    before = gc.get_freeze_count()
    keys = [(RuntimeMode.FULL, BatchDescriptor(n, n, True)) for n in (4, 2)]
    manager.capture_all(keys, lambda m, k: frozen.append(gc.get_freeze_count()), lambda: 0)
    assert all(count > 0 for count in frozen) and len(frozen) == 2
    assert gc.get_freeze_count() == before


def test_manager_refuses_to_capture_an_eager_key() -> None:
    manager = GraphManager("cpu", NO_INDUCTOR)
    with pytest.raises(ValueError, match="NONE"):
        manager.capture(RuntimeMode.NONE, BatchDescriptor(1, 1, True), _affine, [])


def test_manager_rejects_an_unknown_graph_kind() -> None:
    with pytest.raises(ValueError, match="npu"):
        GraphManager("npu", NO_INDUCTOR)


# ---------------------------------------------------------------- piecewise split


def _attention_setup(n: int) -> CPUAttentionBackend:
    """A real backend whose eager slot holds one prefill of n tokens."""
    backend = CPUAttentionBackend(2, 1, 4, 0.5, 4, 16)
    shape = backend.get_kv_cache_shape(6, 4, 1, 4)
    backend.bind_kv_caches([(torch.zeros(shape), torch.zeros(shape)) for _ in range(3)])
    backend.allocate_workspace(1, torch.float32, torch.device("cpu"))
    blocks = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
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
            block_tables=blocks,
            slot_mapping=torch.arange(4, 4 + n),
        )
    )
    return backend


def _three_layers(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for layer in range(3):
        h = x @ w
        x = x + torch.ops.decodegraph.unified_attention(h, h[:, :4], h[:, 4:], layer, EAGER_SLOT)
    return x.tanh()


def test_piecewise_graph_has_layers_plus_one_pieces_and_replays_exactly() -> None:
    x, w = torch.randn(5, 8), torch.randn(8, 8)
    backend = _attention_setup(5)
    with set_forward_context(ForwardContext(backend, EAGER_SLOT)):
        expected = _three_layers(x, w)
        graph = PiecewiseGraph("pw", _three_layers, [x, w], cpu_piece_factory(False))
        assert graph.num_pieces == 4
        torch.testing.assert_close(graph.replay([x, w]), expected)
        x.copy_(torch.randn(5, 8))
        torch.testing.assert_close(graph.replay([x, w]), _three_layers(x, w))


def test_split_at_attention_keeps_every_attention_call_outside_the_pieces() -> None:
    from decodegraph.graphs.graph import trace
    from decodegraph.graphs.piecewise import ATTENTION_OP

    x, w = torch.randn(5, 8), torch.randn(8, 8)
    with set_forward_context(ForwardContext(_attention_setup(5), EAGER_SLOT)):
        split, pieces = split_at_attention(trace(_three_layers, [x, w]))
    for name in pieces:
        targets = [n.target for n in getattr(split, name).graph.nodes]
        assert ATTENTION_OP not in targets, f"{name} holds an attention call"


def test_a_piecewise_graph_checks_input_addresses_on_first_replay() -> None:
    x, w = torch.randn(5, 8), torch.randn(8, 8)
    with set_forward_context(ForwardContext(_attention_setup(5), EAGER_SLOT)):
        graph = PiecewiseGraph("pw", _three_layers, [x, w], cpu_piece_factory(False))
        with pytest.raises(InputAddressError):
            graph.replay([x.clone(), w])


# ---------------------------------------------------------------- on a real engine


def _llm(stories_dir: Path, mode: str, sizes: list[int], **kwargs: object) -> LLM:
    return LLM(
        str(stories_dir),
        compilation_config={
            "cudagraph_mode": mode,
            "cudagraph_capture_sizes": sizes,
            "use_inductor": False,
        },
        max_model_len=128,
        max_num_seqs=8,
        **kwargs,
    )


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def eager_llm(stories_dir: Path) -> LLM:
    return LLM(str(stories_dir), enforce_eager=True, max_model_len=128, max_num_seqs=8)


PROMPTS = [[1, 50, 60], [1, 70, 80, 90, 100], [1, 33]]


def test_capture_uses_dummy_lengths_of_one(stories_dir: Path) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4])
    runner = llm.llm_engine.runner
    graph_slots = [md for md in runner.attn_backend.slots[EAGER_SLOT + 1 :] if md is not None]
    assert len(graph_slots) == runner.capture_stats.num_graphs == 3
    for md in graph_slots:
        assert md.max_seq_len == 1
        assert md.seq_lens_cpu == [1] * md.num_reqs
        assert md.seq_lens_host[: md.num_reqs].tolist() == [1] * md.num_reqs


def test_replay_runs_none_of_the_model_python(stories_dir: Path, eager_llm: LLM) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4])
    calls: list[int] = []
    llm.llm_engine.runner.model.register_forward_pre_hook(lambda *_: calls.append(1))
    assert _greedy(llm, PROMPTS) == _greedy(eager_llm, PROMPTS)
    counts = llm.llm_engine.runner.mode_counts
    assert counts[("decode", "FULL")] == GREEDY.max_tokens - 1
    assert len(calls) == sum(n for (_, mode), n in counts.items() if mode == "NONE")


def test_skipping_update_graph_params_gives_wrong_output(
    stories_dir: Path, eager_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proof that the mechanism matters: graphs replay with their capture-time lengths."""
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4])
    backend = llm.llm_engine.runner.attn_backend
    monkeypatch.setattr(backend, "update_graph_params", lambda slot, metadata: None)
    prompts = PROMPTS[:1]
    assert _greedy(llm, prompts) != _greedy(eager_llm, prompts)
    assert llm.llm_engine.runner.mode_counts[("decode", "FULL")] > 0


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"])
def test_padded_rows_write_no_kv(stories_dir: Path, mode: str) -> None:
    llm = _llm(stories_dir, mode, [1, 2, 4, 8])
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()  # the prefill: 10 tokens, above the largest size, runs eager
    before = [t.clone() for pair in runner.attn_backend.kv_caches for t in pair]
    counts = dict(runner.mode_counts)
    engine.step()  # decode of 3, padded to 4
    ran = {k: v - counts.get(k, 0) for k, v in runner.mode_counts.items() if v != counts.get(k)}
    assert sum(ran.values()) == 1 and next(iter(ran))[1] != "NONE", ran
    written = sorted(runner.buffers.slot_mapping.np[:3].tolist())
    assert runner.buffers.slot_mapping.np[3] == -1  # the padded row
    after = [t for pair in runner.attn_backend.kv_caches for t in pair]
    for old, new in zip(before, after, strict=True):
        slots = changed_slots(old, new)
        block_size = runner.block_size
        # The reserved null block 0 aside, exactly the three real rows' slots changed.
        assert [s for s in slots if s >= block_size] == written


def _tensor_addresses(obj: object) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


def test_workspaces_and_kv_caches_keep_their_addresses_through_replays(
    stories_dir: Path,
) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2, 4, 8])
    backend = llm.llm_engine.runner.attn_backend
    workspaces = _tensor_addresses(backend)
    assert workspaces, "no workspace allocated before capture"
    caches = [t.data_ptr() for pair in backend.kv_caches for t in pair]
    # Eight requests decoding up to max_model_len: the largest workspace use.
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 20 + i] * 10 for i in range(8)], params, use_tqdm=False)
    assert llm.llm_engine.runner.mode_counts[("decode", "FULL")] > 0
    assert _tensor_addresses(backend) == workspaces
    assert [t.data_ptr() for pair in backend.kv_caches for t in pair] == caches


def test_a_graph_replayed_with_other_input_tensors_raises(stories_dir: Path) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2])
    graphs = llm.llm_engine.runner.graphs
    (mode, key), graph = next(iter(graphs.graphs.items()))
    inputs = llm.llm_engine.runner._graph_input_list(key)
    with pytest.raises(InputAddressError):
        graphs.replay(mode, key, [t.clone() for t in inputs])


def test_a_reallocated_persistent_buffer_is_caught_on_first_replay(stories_dir: Path) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2])
    buffers = llm.llm_engine.runner.buffers
    buffers.input_ids = PersistentBuffer(
        (buffers.max_num_tokens,), torch.int64, torch.device("cpu"), 0
    )
    with pytest.raises(InputAddressError):
        _greedy(llm, PROMPTS[:1])


def test_a_late_capture_raises(stories_dir: Path) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1, 2])
    runner = llm.llm_engine.runner
    assert runner.graphs.closed
    with pytest.raises(CaptureClosedError):
        runner.graphs.capture(
            RuntimeMode.FULL, BatchDescriptor(2, 2, True), _affine, [torch.ones(2, 8)]
        )
    with pytest.raises(CaptureClosedError):
        runner._capture_one(RuntimeMode.FULL, BatchDescriptor(1, 1, True))


def test_capturing_all_graphs_again_after_start_up_raises(stories_dir: Path) -> None:
    llm = _llm(stories_dir, "FULL_DECODE_ONLY", [1])
    with pytest.raises(CaptureClosedError):
        llm.llm_engine.runner.capture_graphs()
