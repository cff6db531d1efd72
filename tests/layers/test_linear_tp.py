"""Tensor-parallel layers against the full-size layer, every rank's shard built here.

Each rank's layer is built in this process with an explicit `tp_rank`/`tp_size` and
loaded from the full checkpoint tensors through its weight_loader; putting the ranks'
outputs together as the collectives would (concatenating column-parallel outputs,
summing row-parallel ones) must give the full layer's output. The collectives
themselves are tested on real ranks in tests/distributed and tests/models.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decodegraph.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    attention_heads_per_rank,
)
from decodegraph.layers.vocab import ParallelLMHead, VocabParallelEmbedding


def _loaded(layer: ReplicatedLinear) -> ReplicatedLinear:
    layer.process_weights_after_loading()
    return layer


def test_column_parallel_ranks_concatenated_equal_the_full_layer() -> None:
    w, b, x = torch.randn(12, 8), torch.randn(12), torch.randn(5, 8)
    outs = []
    for rank in range(3):
        layer = ColumnParallelLinear(8, 12, bias=True, tp_rank=rank, tp_size=3)
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
        assert layer.weight.shape == (4, 8)
        outs.append(_loaded(layer)(x))
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.linear(x, w, b))


def test_row_parallel_partial_outputs_sum_to_the_full_layer_bias_added_once() -> None:
    w, b, x = torch.randn(6, 12), torch.randn(6), torch.randn(5, 12)
    total = torch.zeros(5, 6)
    for rank in range(2):
        layer = RowParallelLinear(12, 6, bias=True, reduce_results=False, tp_rank=rank, tp_size=2)
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
        assert layer.weight.shape == (6, 6) and layer.bias.shape == (6,)
        total += _loaded(layer)(x[:, rank * 6 : (rank + 1) * 6])  # its input features
    torch.testing.assert_close(total, F.linear(x, w, b))


def test_merged_gate_up_ranks_hold_their_slice_of_each_projection() -> None:
    gate, up, x = torch.randn(8, 4), torch.randn(8, 4), torch.randn(3, 4)
    gates, ups = [], []
    for rank in range(2):
        layer = MergedColumnParallelLinear(4, [8, 8], tp_rank=rank, tp_size=2)
        layer.weight_loader(layer.weight, up, 1)  # checkpoint order does not matter
        layer.weight_loader(layer.weight, gate, 0)
        out = _loaded(layer)(x)
        gates.append(out[:, :4])
        ups.append(out[:, 4:])
    torch.testing.assert_close(torch.cat(gates, -1), x @ gate.T)
    torch.testing.assert_close(torch.cat(ups, -1), x @ up.T)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "kv_head_of_rank"),
    [
        (8, 4, 2, [[0, 1], [2, 3]]),  # KV heads split
        (4, 1, 2, [[0], [0]]),  # one KV head, replicated on both ranks
        (8, 2, 4, [[0], [0], [1], [1]]),  # two KV heads, each on two ranks
    ],
)
def test_qkv_ranks_hold_their_query_heads_and_split_or_replicated_kv_heads(
    heads: int, kv_heads: int, tp: int, kv_head_of_rank: list[list[int]]
) -> None:
    d, hidden = 4, 16
    q, k = torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden)
    v = torch.randn(kv_heads * d, hidden)
    bias = torch.randn(heads * d + 2 * kv_heads * d)
    qb, kb, vb = bias.split([heads * d, kv_heads * d, kv_heads * d])
    x = torch.randn(3, hidden)
    full_q, full_k, full_v = F.linear(x, q, qb), F.linear(x, k, kb), F.linear(x, v, vb)
    per_rank_q = heads // tp
    qs = []
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, bias=True, tp_rank=rank, tp_size=tp)
        for shard, wt, bt in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            layer.weight_loader(layer.weight, wt, shard)
            layer.weight_loader(layer.bias, bt, shard)
        assert (layer.num_heads, layer.num_kv_heads) == (per_rank_q, len(kv_head_of_rank[rank]))
        out = _loaded(layer)(x)
        rq, rk, rv = out.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        qs.append(rq)
        cols = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kv_head_of_rank[rank]])
        torch.testing.assert_close(rk, full_k[:, cols])
        torch.testing.assert_close(rv, full_v[:, cols])
    torch.testing.assert_close(torch.cat(qs, -1), full_q)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (8, 4, 3, r"tensor_parallel_size \(3\) must divide num_attention_heads \(8\)"),
        (6, 3, 2, r"tensor_parallel_size \(2\) must divide num_key_value_heads \(3\)"),
        (6, 2, 3, r"tensor_parallel_size \(3\) must divide num_key_value_heads \(2\) or be a"),
    ],
)
def test_heads_that_do_not_split_name_tensor_parallel_size(
    heads: int, kv_heads: int, tp: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        attention_heads_per_rank(heads, kv_heads, tp)
    with pytest.raises(ValueError, match=message):
        QKVParallelLinear(16, 4, heads, kv_heads, tp_rank=0, tp_size=tp)


def test_linear_sizes_that_do_not_split_name_tensor_parallel_size() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must divide the output"):
        ColumnParallelLinear(8, 6, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must divide the input"):
        RowParallelLinear(6, 8, tp_rank=0, tp_size=4)


def test_vocab_is_padded_and_each_rank_embeds_only_its_ids() -> None:
    vocab, dim = 10, 4  # tp 3: padded to 12, four rows a rank, the last two are padding
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 3, 4, 7, 8, 9, 2])
    total = torch.zeros(len(ids), dim)
    for rank in range(3):
        emb = VocabParallelEmbedding(vocab, dim, tp_rank=rank, tp_size=3)
        emb.weight_loader(emb.weight, table)
        assert emb.weight.shape == (4, dim) and emb.num_embeddings_padded == 12
        # World of one here: the all-reduce is the identity, so this is the rank's part.
        part = emb(ids)
        mine = (ids >= 4 * rank) & (ids < 4 * rank + 4)
        assert torch.all(part[~mine] == 0)
        total += part
    assert torch.all(emb.weight[2:] == 0)  # rank 2's padding rows
    torch.testing.assert_close(total, F.embedding(ids, table))


def test_lm_head_slices_concatenated_and_trimmed_are_the_full_logits() -> None:
    vocab, dim = 10, 4
    table, h = torch.randn(vocab, dim), torch.randn(3, dim)
    slices = []
    for rank in range(3):
        head = ParallelLMHead(vocab, dim, tp_rank=rank, tp_size=3)
        head.weight_loader(head.weight, table)
        slices.append(F.linear(h, head.weight))
    logits = torch.cat(slices, -1)[:, :vocab]  # what gather_logits does across ranks
    torch.testing.assert_close(logits, F.linear(h, table))


def _op_names(fn, *args) -> set[str]:
    with torch.profiler.profile() as prof:
        fn(*args)
    return {e.name for e in prof.events()}


def test_at_tensor_parallel_one_layers_run_only_their_matmul_or_lookup() -> None:
    row = RowParallelLinear(8, 6, bias=True, tp_rank=0, tp_size=1)
    row.weight.data.normal_()
    row.bias.data.normal_()
    row.process_weights_after_loading()
    x = torch.randn(2, 8)
    assert torch.equal(row(x), F.linear(x, row.weight, row.bias))
    names = _op_names(row, x)
    assert "aten::addmm" in names and not any("c10d" in n or n == "aten::add" for n in names)

    emb = VocabParallelEmbedding(10, 4, tp_rank=0, tp_size=1)
    emb.weight.data.normal_()
    ids = torch.tensor([1, 9])
    assert emb.weight.shape == (10, 4)
    names = _op_names(emb, ids)
    assert "aten::embedding" in names
    assert not names & {"aten::where", "aten::masked_fill", "aten::ge", "aten::lt"}
