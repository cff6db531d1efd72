"""The CPU paged-attention backend against a naive dense reference.

Each case lays out real requests over a real paged KV cache (random, distinct block ids),
writes their context, runs one step through the backend and compares every real row with
softmax(q k^T * scale) v over the request's dense K/V (causal, with the context offset).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import decodegraph.attention.layer  # noqa: F401  (registers the attention ops)
from decodegraph.attention.backends.base import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
)
from decodegraph.attention.backends.torch_paged import (
    CPUAttentionBackend,
    CUDATorchAttentionBackend,
)
from decodegraph.forward_context import EAGER_PARAMS_ID, ForwardContext, set_forward_context
from decodegraph.native import load_cpu_ops
from tests.utils.kv import changed_slots
from tests.utils.native import outputs_under_settings

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
NUM_BLOCKS = 40
MAX_NUM_REQS = 4
NUM_LAYERS = 2


@dataclass
class Case:
    backend: AttentionBackend
    metadata: AttentionMetadata
    query: torch.Tensor  # [padded tokens, h * d]
    key: torch.Tensor  # [padded tokens, kvh * d]
    value: torch.Tensor
    expected: torch.Tensor  # [real tokens, h * d]
    slots: list[int]  # KV slots the real tokens write


class TorchOpsAttentionBackend(CPUAttentionBackend):
    """The same backend on its tensor-op path (the native attention operator opted out)."""

    use_native_kernel = False


def require_native_op() -> None:
    """Skip where no C++ compiler exists; where one does, a failed build is a failure."""
    if load_cpu_ops() is not None:
        return
    if shutil.which("c++") or shutil.which("g++"):
        pytest.fail("a C++ compiler is here but the native attention operator did not build")
    pytest.skip("the native attention operator cannot be built here (no C++ compiler)")


@pytest.fixture(params=["native", "torch-ops"])
def kernel(request: pytest.FixtureRequest) -> str:
    """Attention runs in the native operator (when it builds here) or in tensor ops: test
    both."""
    if request.param == "native":
        require_native_op()
    return request.param


def make_backend(
    kernel: str,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 8,
    block_size: int = BLOCK_SIZE,
    max_model_len: int = MAX_MODEL_LEN,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    num_blocks: int = NUM_BLOCKS,
) -> AttentionBackend:
    if kernel == "triton":  # only under TRITON_INTERPRET=1 here (test_triton_attn.py)
        from decodegraph.attention.backends.triton_attn import TritonAttentionBackend as cls
    else:
        cls = CPUAttentionBackend if kernel == "native" else TorchOpsAttentionBackend
    backend = cls(
        num_heads,
        num_kv_heads,
        head_size,
        head_size**-0.5,
        block_size,
        max_model_len,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    backend.bind_kv_caches([(torch.zeros(shape), torch.zeros(shape)) for _ in range(NUM_LAYERS)])
    backend.allocate_workspace(MAX_NUM_REQS, torch.float32, torch.device("cpu"))
    return backend


class _TokenSlots:
    """A layer's cache addressed by slot (block * block_size + offset) -> [kvh, d]."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.tokens = CPUAttentionBackend.token_view(cache)
        self.block_size = self.tokens.shape[1]

    def _index(self, slots: int | torch.Tensor) -> tuple:
        return (slots // self.block_size, slots % self.block_size)

    def __getitem__(self, slots: int | torch.Tensor) -> torch.Tensor:
        return self.tokens[self._index(slots)]

    def __setitem__(self, slots: int | torch.Tensor, value: torch.Tensor) -> None:
        self.tokens[self._index(slots)] = value


def token_slots(backend: AttentionBackend, layer_idx: int) -> tuple[_TokenSlots, _TokenSlots]:
    k_cache, v_cache = backend.kv_caches[layer_idx]
    return _TokenSlots(k_cache), _TokenSlots(v_cache)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: int,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """q [q_len, h, d] at positions context.., k/v [length, kvh, d] -> [q_len, h * d];
    a query at position p sees keys (p - window, p] (Hugging Face's sliding window), and
    scores are capped as cap * tanh(score / cap) (Gemma 2)."""
    q_len, h, d = q.shape
    group = h // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(context, context + q_len)[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = k_pos > q_pos
    if window:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q_len, h * d)


def make_case(
    backend: AttentionBackend,
    reqs: list[tuple[int, int]],
    layer_idx: int = 0,
    pad_tokens: int = 0,
    pad_reqs: int = 0,
    seed: int = 0,
    key_scale: float = 1.0,
) -> Case:
    """`reqs` holds (context already cached, new tokens) per request; keys are standard
    normal times `key_scale`."""
    gen = torch.Generator().manual_seed(seed)
    h, kvh, d, bs = backend.num_heads, backend.num_kv_heads, backend.head_size, backend.block_size
    k_tokens, v_tokens = token_slots(backend, layer_idx)
    # Block 0 is the reserved null block; the others go out shuffled.
    num_blocks = backend.kv_caches[layer_idx][0].shape[0]
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    num_reqs, num_tokens = len(reqs), sum(n for _, n in reqs)
    padded_reqs, padded_tokens = num_reqs + pad_reqs, num_tokens + pad_tokens
    block_tables = torch.zeros(padded_reqs, backend.max_blocks_per_seq, dtype=torch.int32)
    seq_lens = torch.zeros(padded_reqs, dtype=torch.int32)
    qsl = [0]
    slot_mapping = torch.full((padded_tokens,), -1, dtype=torch.int64)
    query = torch.randn(padded_tokens, h * d, generator=gen)
    key = torch.randn(padded_tokens, kvh * d, generator=gen)
    value = torch.randn(padded_tokens, kvh * d, generator=gen)
    expected, slots = [], []
    for i, (context, n) in enumerate(reqs):
        length = context + n
        blocks = [free.pop() for _ in range(-(-length // bs))]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        seq_lens[i] = length
        start = qsl[-1]
        qsl.append(start + n)
        req_slots = [blocks[p // bs] * bs + p % bs for p in range(length)]
        k_dense = torch.randn(length, kvh, d, generator=gen) * key_scale
        v_dense = torch.randn(length, kvh, d, generator=gen)
        for p in range(context):  # the cached context
            k_tokens[req_slots[p]] = k_dense[p]
            v_tokens[req_slots[p]] = v_dense[p]
        key[start : start + n] = k_dense[context:].reshape(n, kvh * d)
        value[start : start + n] = v_dense[context:].reshape(n, kvh * d)
        slot_mapping[start : start + n] = torch.tensor(req_slots[context:])
        slots += req_slots[context:]
        q = query[start : start + n].view(n, h, d)
        expected.append(
            reference(
                q,
                k_dense,
                v_dense,
                context,
                backend.scale,
                backend.sliding_window,
                backend.logits_soft_cap,
            )
        )
    uniform = all(n == 1 for _, n in reqs)
    qsl_padded = qsl + [num_tokens] * pad_reqs
    metadata = AttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(n for _, n in reqs),
        max_seq_len=max(c + n for c, n in reqs),
        uniform_decode=uniform,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[c + n for c, n in reqs],
        query_start_loc=torch.tensor(qsl_padded, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
    )
    return Case(backend, metadata, query, key, value, torch.cat(expected), slots)


def run(case: Case, layer_idx: int = 0) -> torch.Tensor:
    """One step through the registered op, as a model calls it."""
    case.backend.set_eager_metadata(case.metadata)
    with set_forward_context(ForwardContext(case.backend, EAGER_PARAMS_ID)):
        return torch.ops.decodegraph.unified_attention(
            case.query, case.key, case.value, layer_idx, EAGER_PARAMS_ID
        )


def check(case: Case, out: torch.Tensor) -> None:
    n = case.metadata.num_actual_tokens
    assert out.shape == case.query.shape
    torch.testing.assert_close(out[:n], case.expected, rtol=1e-5, atol=1e-5)


def make_bfloat16_case(backend: AttentionBackend, reqs: list[tuple[int, int]]) -> Case:
    """`make_case` over bfloat16 caches and workspace, with bfloat16 q/k/v (the reference
    stays float32)."""
    backend.bind_kv_caches([(k.bfloat16(), v.bfloat16()) for k, v in backend.kv_caches])
    backend.allocate_workspace(MAX_NUM_REQS, torch.bfloat16, torch.device("cpu"))
    case = make_case(backend, reqs)
    for name in ("query", "key", "value"):
        setattr(case, name, getattr(case, name).bfloat16())
    return case


def check_bfloat16(case: Case, out: torch.Tensor) -> None:
    n = case.metadata.num_actual_tokens
    torch.testing.assert_close(out[:n].float(), case.expected, rtol=3e-2, atol=3e-2)


GQA = [(4, 4), (4, 2), (4, 1), (6, 3)]


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA, ids=lambda x: str(x))
def test_prefill_is_causal(kernel: str, num_heads: int, num_kv_heads: int) -> None:
    case = make_case(make_backend(kernel, num_heads, num_kv_heads), [(0, 7)])
    check(case, run(case))


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA, ids=lambda x: str(x))
@pytest.mark.parametrize("context, chunk", [(5, 6), (4, 4), (1, 2), (9, 1), (12, 20)])
def test_chunked_prefill_attends_over_the_context_offset(
    kernel: str, num_heads: int, num_kv_heads: int, context: int, chunk: int
) -> None:
    case = make_case(make_backend(kernel, num_heads, num_kv_heads), [(context, chunk)])
    check(case, run(case))


@pytest.mark.parametrize("scores", [1, 4 * 24 * 3])
def test_queries_after_a_context_go_in_chunks_of_bounded_scores(
    monkeypatch: pytest.MonkeyPatch, scores: int
) -> None:
    """The tensor-op path holds at most _MASKED_SCORES scores per masked call: one query
    row per call at the smallest bound, three at the other; same outputs as one call."""
    import decodegraph.attention.backends.torch_paged as torch_paged

    monkeypatch.setattr(torch_paged, "_MASKED_SCORES", scores)
    calls = []
    sdpa = torch_paged.F.scaled_dot_product_attention
    monkeypatch.setattr(
        torch_paged.F,
        "scaled_dot_product_attention",
        lambda q, *a, **kw: calls.append(q.shape[2]) or sdpa(q, *a, **kw),
    )
    case = make_case(make_backend("torch-ops", 4, 2), [(12, 12), (0, 5)])
    check(case, run(case))
    # The first request's 12 queries over 24 positions; the whole prompt is one call.
    assert calls == ([1] * 12 if scores == 1 else [3] * 4) + [5]


@pytest.mark.parametrize("head_size", [8, 64])
@pytest.mark.parametrize(
    "lengths", [[16], [1, 15, 17, 32], [33, 48, 100, 128], [127, 64, 5, 31]], ids=str
)
def test_decode_at_the_default_block_size(kernel: str, head_size: int, lengths: list[int]) -> None:
    """Block size 16 (the default, which the C kernel runs one vector wide); lengths on
    and off block boundaries."""
    backend = make_backend(kernel, 8, 2, head_size, block_size=16, max_model_len=128)
    case = make_case(backend, [(n - 1, 1) for n in lengths])
    check(case, run(case))


@pytest.mark.parametrize("num_heads, head_size", [(16, 64), (12, 128)], ids=str)
def test_a_large_query_group_at_the_default_block_size(
    kernel: str, num_heads: int, head_size: int
) -> None:
    """One KV head for many query heads (the native operator splits such a group)."""
    backend = make_backend(kernel, num_heads, 1, head_size, block_size=16, max_model_len=64)
    case = make_case(backend, [(40, 1), (0, 9), (17, 1)])
    check(case, run(case))


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA, ids=lambda x: str(x))
@pytest.mark.parametrize("lengths", [[1], [13], [32], [1, 5, 13, 9], [32, 2, 17], [4, 4]])
def test_decode_batch_with_different_lengths(
    kernel: str, num_heads: int, num_kv_heads: int, lengths: list[int]
) -> None:
    case = make_case(make_backend(kernel, num_heads, num_kv_heads), [(n - 1, 1) for n in lengths])
    assert case.metadata.uniform_decode
    check(case, run(case))


def test_mixed_batch_of_decodes_chunks_and_prefills(kernel: str) -> None:
    case = make_case(make_backend(kernel), [(6, 1), (0, 5), (3, 4), (10, 1), (0, 1)])
    assert not case.metadata.uniform_decode
    check(case, run(case))


@pytest.mark.parametrize("head_size", [8, 64])
def test_mixed_batch_at_the_default_block_size(kernel: str, head_size: int) -> None:
    """Block size 16 (the native operator's vector path): prompts and chunks that start,
    end and cross block boundaries beside decodes."""
    backend = make_backend(kernel, 8, 2, head_size, block_size=16, max_model_len=128)
    case = make_case(backend, [(0, 37), (16, 16), (90, 1), (21, 30)])
    check(case, run(case))


@pytest.mark.parametrize("block_size", [32, 128])
def test_decode_and_mixed_batches_at_block_sizes_above_16(kernel: str, block_size: int) -> None:
    """Block sizes that are multiples of 16 (the native operator's vector path covers them
    16 positions at a time): lengths on, off and across block and sub-block boundaries."""
    backend = make_backend(kernel, 8, 2, 64, block_size=block_size, max_model_len=512)
    decodes = make_case(backend, [(n - 1, 1) for n in [1, 31, 33, 128, 129, 200]])
    check(decodes, run(decodes))
    mixed = make_case(backend, [(0, 70), (130, 1), (40, 100), (127, 2)], seed=1)
    check(mixed, run(mixed))


# A step of the native operator with more work than its single-thread limit (2**20 query
# tokens x positions x heads x head size): it splits its requests over the threads.
_LARGE_STEP = [(0, 40), (99, 1), (120, 1), (60, 1), (200, 1), (15, 20)]


def test_a_large_step_split_over_threads_gives_the_same_bits(restore_threads: None) -> None:
    require_native_op()
    outs = []
    # Workspaces for 1 and for 3 threads, then one for 1 thread run at 4 threads (the
    # operator uses no more workspace rows than it has).
    for allocate, run_at in ((1, 1), (3, 3), (1, 4)):
        torch.set_num_threads(allocate)
        backend = make_backend("native", 16, 4, 64, block_size=16, max_model_len=256)
        torch.set_num_threads(run_at)
        case = make_case(backend, _LARGE_STEP)
        out = run(case)
        check(case, out)
        outs.append(out)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


# In a child process (the operator reads DECODEGRAPH_CPU_ROWS_AHEAD once per process):
# a decode step whose K and V pass the operator's fetch-ahead threshold, with more decode
# rows than it fetches ahead, checked against the reference and saved.
_ROWS_AHEAD_STEP = """
import sys, torch
from tests.attention.test_torch_paged import check, make_backend, make_case, run
backend = make_backend("native", 16, 4, 64, block_size=16, max_model_len=512, num_blocks=256)
case = make_case(backend, [(200 + 7 * i, 1) for i in range(12)])
out = run(case)
check(case, out)
torch.save(out, sys.argv[1])
"""


def test_fetching_later_rows_ahead_or_not_gives_the_same_bits(tmp_path) -> None:  # noqa: ANN001
    require_native_op()
    off, on = outputs_under_settings(_ROWS_AHEAD_STEP, "DECODEGRAPH_CPU_ROWS_AHEAD", tmp_path)
    assert torch.equal(off, on)


def test_each_layer_has_its_own_cache(kernel: str) -> None:
    backend = make_backend(kernel)
    case = make_case(backend, [(3, 2)], layer_idx=1)
    check(case, run(case, layer_idx=1))
    assert not backend.kv_caches[0][0].any(), "layer 0's cache was written by layer 1"


@pytest.mark.parametrize(
    "reqs, pad_reqs",
    [([(4, 1), (9, 1), (0, 1)], 1), ([(12, 1)], 1), ([(2, 1), (5, 1)], 6)],
    ids=["3-to-4", "1-to-2", "2-to-8"],
)
def test_padded_decode_rows_write_no_kv_and_leave_real_rows_alone(
    kernel: str, reqs: list[tuple[int, int]], pad_reqs: int
) -> None:
    backend = make_backend(kernel)
    case = make_case(backend, reqs, pad_tokens=pad_reqs, pad_reqs=pad_reqs)
    before = [t.clone() for pair in backend.kv_caches for t in pair]
    out = run(case)
    check(case, out)
    assert torch.isfinite(out).all()
    _assert_only_slots_written(backend, before, case.slots)


def test_padded_mixed_rows_write_no_kv_and_leave_real_rows_alone(kernel: str) -> None:
    backend = make_backend(kernel)
    case = make_case(backend, [(3, 4), (0, 2)], pad_tokens=2)
    before = [t.clone() for pair in backend.kv_caches for t in pair]
    out = run(case)
    check(case, out)
    assert torch.isfinite(out).all()
    _assert_only_slots_written(backend, before, case.slots)


def _assert_only_slots_written(
    backend: AttentionBackend, before: list[torch.Tensor], slots: list[int]
) -> None:
    for old, new in zip(before[:2], backend.kv_caches[0], strict=True):
        assert sorted(changed_slots(old, new)) == sorted(slots)
    for old, new in zip(
        before[2:], [t for pair in backend.kv_caches[1:] for t in pair], strict=True
    ):
        assert torch.equal(old, new), "another layer's cache changed"


def test_kv_of_the_new_tokens_lands_in_their_slots(kernel: str) -> None:
    backend = make_backend(kernel)
    case = make_case(backend, [(2, 3), (0, 1)])
    run(case)
    k_tokens, v_tokens = token_slots(backend, 0)
    n, kvh, d = case.metadata.num_actual_tokens, backend.num_kv_heads, backend.head_size
    slots = torch.tensor(case.slots)
    torch.testing.assert_close(k_tokens[slots], case.key[:n].view(n, kvh, d))
    torch.testing.assert_close(v_tokens[slots], case.value[:n].view(n, kvh, d))


def _tensor_addresses(backend: AttentionBackend) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in vars(backend).items() if isinstance(v, torch.Tensor)}


def test_workspace_is_allocated_once_and_reused_at_full_length(kernel: str) -> None:
    """Every request at max_model_len, the largest batch: no new allocation."""
    backend = make_backend(kernel)
    addresses = _tensor_addresses(backend)
    assert addresses, "the backend holds no workspace tensors"
    lengths = [MAX_MODEL_LEN] * MAX_NUM_REQS
    for reqs in ([(n - 1, 1) for n in lengths], [(MAX_MODEL_LEN - 8, 8)] * 2):
        case = make_case(backend, reqs)
        check(case, run(case))
        assert _tensor_addresses(backend) == addresses


def test_update_graph_params_refreshes_host_values_and_keeps_tensor_views(kernel: str) -> None:
    backend = make_backend(kernel)
    captured = make_case(backend, [(0, 1), (0, 1)]).metadata
    params_id = backend.new_graph_params(captured)
    assert params_id != EAGER_PARAMS_ID
    views = {f: getattr(captured, f) for f in ("seq_lens", "block_tables", "slot_mapping")}
    step = make_case(backend, [(7, 1), (3, 1)], seed=1).metadata
    backend.update_graph_params(params_id, step)
    target = backend.params[params_id]
    for name in AttentionMetadata.HOST_FIELDS:
        assert getattr(target, name) == getattr(step, name), name
    for name, tensor in views.items():
        assert getattr(target, name) is tensor, f"{name} must keep its capture-time view"
    # The host copy of seq_lens the kernels read is the graph's own, refreshed in place.
    assert target.seq_lens_host is not step.seq_lens_host
    assert target.seq_lens_host[:2].tolist() == [8, 4]


def test_graph_params_are_independent_of_the_eager_params(kernel: str) -> None:
    backend = make_backend(kernel)
    graph_case = make_case(backend, [(5, 1)])
    params_id = backend.new_graph_params(graph_case.metadata)
    eager_case = make_case(backend, [(0, 3)], seed=2)
    backend.set_eager_metadata(eager_case.metadata)
    with set_forward_context(ForwardContext(backend, params_id)):
        out = torch.ops.decodegraph.unified_attention(
            graph_case.query, graph_case.key, graph_case.value, 0, params_id
        )
    check(graph_case, out)


def test_attention_with_output_writes_the_given_tensor_in_place(kernel: str) -> None:
    """The op a piecewise graph splits at: the attention written into the output it is
    given (padded rows zero), so that the output keeps its address."""
    backend = make_backend(kernel)
    case = make_case(backend, [(3, 2), (0, 4)], pad_tokens=2)
    output = torch.full_like(case.query, float("nan"))
    address = output.data_ptr()
    backend.set_eager_metadata(case.metadata)
    with set_forward_context(ForwardContext(backend, EAGER_PARAMS_ID)):
        torch.ops.decodegraph.unified_attention_with_output(
            case.query, case.key, case.value, output, 0, EAGER_PARAMS_ID
        )
    assert output.data_ptr() == address
    check(case, output)
    n = case.metadata.num_actual_tokens
    assert torch.equal(output[n:], torch.zeros_like(output[n:]))


WINDOW_CASES = {
    # (context already cached, new tokens) per request.
    "decodes": [(3, 1), (9, 1), (20, 1), (31, 1)],
    "prefill-longer-than-the-window": [(0, 23)],
    "chunk-across-the-window-edge": [(5, 6), (14, 9)],
    "mixed": [(25, 1), (0, 13), (11, 4)],
}


@pytest.mark.parametrize("window", [1, 5, 8])
@pytest.mark.parametrize("case_name", list(WINDOW_CASES))
def test_a_sliding_window_sees_the_last_w_positions(
    kernel: str, window: int, case_name: str
) -> None:
    backend = make_backend(kernel, sliding_window=window)
    case = make_case(backend, WINDOW_CASES[case_name], seed=window)
    check(case, run(case))


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("window", [7, 16, 40])
def test_a_sliding_window_at_vector_block_sizes(kernel: str, block_size: int, window: int) -> None:
    """Windows that start inside a block, on a block boundary, and past the context."""
    backend = make_backend(kernel, 8, 2, 16, block_size, 128, sliding_window=window, num_blocks=96)
    case = make_case(backend, [(n - 1, 1) for n in (3, 17, 48, 100)] + [(60, 9), (0, 33)])
    check(case, run(case))


@pytest.mark.parametrize("cap", [0.5, 2.0, 50.0])
def test_logit_soft_capping_matches_the_reference(kernel: str, cap: float) -> None:
    backend = make_backend(kernel, 8, 2, 16, 16, 64, logits_soft_cap=cap)
    case = make_case(backend, [(30, 1), (0, 12), (6, 5)], key_scale=4.0)
    check(case, run(case))


def test_a_window_and_soft_capping_together(kernel: str) -> None:
    backend = make_backend(kernel, 8, 4, 8, 16, 64, sliding_window=10, logits_soft_cap=3.0)
    case = make_case(backend, [(40, 1), (0, 30), (20, 7)], key_scale=3.0)
    check(case, run(case))


def test_the_native_window_never_reads_blocks_before_it() -> None:
    """Blocks wholly before every query's window hold NaN: the operator's result is
    unchanged, so it skips them (its cost follows the window, and a sliding-window KV
    group may free them)."""
    require_native_op()
    backend = make_backend("native", 8, 2, 16, 16, 128, sliding_window=16)
    case = make_case(backend, [(99, 1), (70, 6)])
    k_cache, v_cache = backend.kv_caches[0]
    bt, lengths = case.metadata.block_tables, [100, 76]
    for r, length in enumerate(lengths):
        first_needed = (length - 6 - 16 + 1) // 16  # the earliest query's window start
        for b in range(max(first_needed, 0)):
            k_cache[bt[r, b]] = float("nan")
            v_cache[bt[r, b]] = float("nan")
    check(case, run(case))


@pytest.mark.parametrize("block_size", [4, 16])
def test_bfloat16_with_a_window_and_soft_capping(kernel: str, block_size: int) -> None:
    backend = make_backend(
        kernel, 8, 2, 16, block_size, 64, sliding_window=12, logits_soft_cap=20.0
    )
    case = make_bfloat16_case(backend, [(40, 1), (0, 20), (25, 3)])
    check_bfloat16(case, run(case))


def test_backends_declare_their_graph_support() -> None:
    assert CPUAttentionBackend.cudagraph_support is AttentionCGSupport.ALWAYS
    assert (
        CUDATorchAttentionBackend.cudagraph_support
        is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )


@pytest.mark.parametrize("lengths", [[1], [9, 3, 17], [5, 30]], ids=str)
def test_cuda_torch_takes_its_graph_safe_branch_under_a_graphs_params(
    lengths: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The branch follows the params id in the forward context, so a full graph's
    warm-up runs the very code its capture records (not "am I capturing", which the
    warm-up is not). Both branches agree with the reference, padded rows included."""
    backend = CUDATorchAttentionBackend(4, 2, 8, 8**-0.5, 4, 64)
    shape = backend.get_kv_cache_shape(NUM_BLOCKS, 4, 2, 8)
    backend.bind_kv_caches([(torch.zeros(shape), torch.zeros(shape)) for _ in range(NUM_LAYERS)])
    backend.allocate_workspace(MAX_NUM_REQS, torch.float32, torch.device("cpu"))
    pad = MAX_NUM_REQS - len(lengths)  # a graph's size: at most max_num_seqs rows
    case = make_case(backend, [(n - 1, 1) for n in lengths], pad_tokens=pad, pad_reqs=pad)
    eager_branch = []
    parent = CPUAttentionBackend.forward

    def counting(self, *args):  # noqa: ANN001, ANN202
        eager_branch.append(args[-1])
        return parent(self, *args)

    monkeypatch.setattr(CPUAttentionBackend, "forward", counting)
    check(case, run(case))
    params_id = backend.new_graph_params(case.metadata)
    with set_forward_context(ForwardContext(backend, params_id)):
        out = torch.ops.decodegraph.unified_attention(
            case.query, case.key, case.value, 0, params_id
        )
    check(case, out)
    assert eager_branch == [EAGER_PARAMS_ID]


_BAD_METADATA = """
import sys
import torch
from decodegraph.attention.backends.base import AttentionMetadata
from decodegraph.attention.backends.torch_paged import CPUAttentionBackend
b = CPUAttentionBackend(4, 2, 8, 0.35, 4, 32)
shape = b.get_kv_cache_shape(40, 4, 2, 8)
b.bind_kv_caches([(torch.zeros(shape), torch.zeros(shape))])
b.allocate_workspace(64, torch.float32, torch.device("cpu"))
if sys.argv[1] == "oversized":  # the metadata claims 64 requests; the tensors hold 2 rows
    n, qsl, lens, slot = 64, list(range(65)), [32] * 64, 10**9
else:  # one request of 5 new tokens whose context holds only 3 positions
    n, qsl, lens, slot = 1, [0, 5], [3], 1
md = AttentionMetadata(
    num_reqs=n, num_actual_tokens=qsl[-1], max_query_len=qsl[1], max_seq_len=32,
    uniform_decode=qsl[-1] == n, query_start_loc_cpu=qsl, seq_lens_cpu=lens,
    query_start_loc=torch.tensor(qsl, dtype=torch.int32),
    seq_lens=torch.tensor(lens, dtype=torch.int32),
    block_tables=torch.full((n, 8), 39, dtype=torch.int32),
    slot_mapping=torch.full((max(n, qsl[-1]),), slot, dtype=torch.int64),
)
b.set_eager_metadata(md)
rows = min(2, qsl[-1]) if n > 1 else qsl[-1]
try:
    q = torch.randn(rows, 32)
    b.forward(q, torch.randn(rows, 16), torch.randn(rows, 16), torch.empty_like(q), 0, 0)
except (ValueError, RuntimeError, IndexError, AssertionError) as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("bad", ["oversized", "query-longer-than-context"])
def test_the_native_operator_refuses_metadata_outside_its_tensors(bad: str) -> None:
    require_native_op()
    # In a child process: an unchecked kernel call may crash the interpreter.
    proc = subprocess.run(
        [sys.executable, "-c", _BAD_METADATA, bad], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"the kernel crashed (signal {-proc.returncode})"
    assert "refused:" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_loading_the_native_operator_keeps_ieee_subnormals() -> None:
    # A library linked with -ffast-math would switch the process to flush-to-zero.
    require_native_op()
    assert sys.float_info.min / 4 > 0.0


def test_softmax_weights_below_the_normal_range_and_the_threads_fp_mode() -> None:
    """Keys 40x larger put most scores 100+ below their row's maximum: their weights and
    products are subnormal, which the kernel flushes to zero while it runs (they are
    below 2**-126 of the largest term), and the calling thread computes subnormals
    again afterwards."""
    require_native_op()
    backend = make_backend("native", 8, 2, 8, block_size=16, max_model_len=128)
    case = make_case(backend, [(n - 1, 1) for n in [128, 77, 3]] + [(20, 30)], key_scale=40.0)
    check(case, run(case))
    assert torch.tensor([1e-39]).mul(1.0).item() > 0.0
    assert sys.float_info.min / 4 > 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [8, 24, 64, 80, 128, 256, 576])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 48])
def test_the_native_operator_at_every_block_size_and_head_size(
    block_size: int, head_size: int, dtype: torch.dtype
) -> None:
    """The native operator at block sizes below, at, between and above its vector widths
    (4, 8 or 16 positions), and head sizes of real models (Qwen3 128, Gemma 256, 80: no
    power of two; 576, wider than the operator's accumulators, goes in slices): decodes
    on and across block boundaries beside a prefill chunk."""
    require_native_op()
    num_blocks = 200 // block_size + 8
    backend = make_backend("native", 4, 2, head_size, block_size, 64, num_blocks=num_blocks)
    reqs = [(n - 1, 1) for n in (1, 7, 33, 50)] + [(5, 12)]
    if dtype == torch.bfloat16:
        case = make_bfloat16_case(backend, reqs)
        check_bfloat16(case, run(case))
    else:
        case = make_case(backend, reqs)
        check(case, run(case))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 2), (8, 4)], ids=str)
@pytest.mark.parametrize("head_size", [8, 16])
def test_small_float32_groups_over_whole_blocks(
    num_heads: int, num_kv_heads: int, head_size: int
) -> None:
    """Float32 groups of at most 16 accumulators at block size 16 with the whole context
    in view (the native operator's whole-block path, stories260K's shape among them):
    contexts of one position, inside the first vector, on and across vector and block
    boundaries, several blocks long, beside a prefill chunk, which crosses a boundary."""
    require_native_op()
    backend = make_backend("native", num_heads, num_kv_heads, head_size, 16, 128, num_blocks=80)
    lengths = (1, 3, 8, 9, 15, 16, 17, 31, 32, 33, 100, 128)
    case = make_case(backend, [(n - 1, 1) for n in lengths] + [(10, 13)])
    check(case, run(case))


@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_bfloat16_decode_matches_the_reference(kernel: str, block_size: int) -> None:
    """bf16 caches and q/k/v (the native operator computes in float32 from them; block
    sizes that are multiples of 16 take its vector path where AVX-512 is present)."""
    backend = make_backend(kernel, 8, 2, 16, block_size=block_size, max_model_len=64)
    case = make_bfloat16_case(backend, [(n - 1, 1) for n in [1, 17, 40, 64]])
    out = run(case)
    assert out.dtype == torch.bfloat16
    check_bfloat16(case, out)
    n = case.metadata.num_actual_tokens
    k_tokens, _ = token_slots(backend, 0)
    slots = torch.tensor(case.slots)
    assert torch.equal(k_tokens[slots], case.key[:n].view(n, 2, 16))  # stored bit for bit


def test_bfloat16_mixed_batch_matches_the_reference(kernel: str) -> None:
    backend = make_backend(kernel, 8, 2, 16, block_size=16, max_model_len=64)
    case = make_bfloat16_case(backend, [(0, 20), (30, 1), (5, 12)])
    check_bfloat16(case, run(case))


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_large_enough_to_fetch_ahead_matches_the_reference(
    dtype: str, window: int | None
) -> None:
    """Decode rows whose K and V pass the native operator's fetch-ahead size (1 MiB per
    layer; here 12 decodes of about 240 positions, 8 KV heads of 64: 2.4 MiB and more in
    every case), with a prefill between them (no fetch-ahead into or out of it: the rows
    that would fetch it four rows ahead, and the last rows, fetch nothing) and scattered
    blocks: the same results as the reference."""
    require_native_op()
    backend = make_backend(
        "native",
        16,
        8,
        64,
        block_size=16,
        max_model_len=256,
        sliding_window=window,
        num_blocks=220,
    )
    reqs = [(230 + 3 * i, 1) for i in range(6)] + [(0, 9)] + [(250 - i, 1) for i in range(6)]
    if dtype == "bfloat16":
        case = make_bfloat16_case(backend, reqs)
        check_bfloat16(case, run(case))
    else:
        case = make_case(backend, reqs)
        check(case, run(case))
