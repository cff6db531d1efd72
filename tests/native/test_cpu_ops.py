"""decodegraph's CPU operators split large inputs over torch's intra-op threads: each
row is computed by exactly one thread, so every split gives the bits of one thread.
The batch-1 projection is as exact as BLAS's (float32) and torch.mm's (bfloat16), and
the layers use it at batch 1, in eager steps and in traced and compiled graphs. Compiled
graphs call the opaque operators through their C shims, not the dispatcher."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.utils.native import outputs_under_settings


@pytest.fixture
def c_shims(cpu_ops: object) -> object:
    """The operators, where graphs call them through their C shims (native.c_shims: the
    operators' library made global)."""
    from decodegraph import native

    if not native.c_shims():
        pytest.skip("the operators' C shims could not be made global here")
    return cpu_ops


def _ops(cpu_ops: object) -> dict[str, Callable[[], object]]:
    """Inputs of 2048 rows (several grain sizes for every op), strided where allowed."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(2048, 2 * 344 + 8, generator=gen)
    x, res = wide[:, :64], torch.randn(2048, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    qk = wide[:, : 12 * 8].view(2048, 12, 8)
    cos, sin = torch.randn(2048, 8, generator=gen), torch.randn(2048, 8, generator=gen)
    weight, bias = torch.randn(4099, 344, generator=gen), torch.randn(4099, generator=gen)
    wide16, weight16, bias16 = wide.bfloat16(), weight.bfloat16(), bias.bfloat16()
    return {
        "linear_one_row": lambda: cpu_ops.linear_one_row(wide[:1, :344], weight, bias),
        "linear_one_row_bf16": lambda: cpu_ops.linear_one_row(wide16[:1, :344], weight16, bias16),
        "linear_few_rows": lambda: cpu_ops.linear_few_rows(wide[:5, :344], weight, bias),
        "linear_few_rows_bf16": lambda: cpu_ops.linear_few_rows(wide16[:5, :344], weight16, bias16),
        "silu_and_mul": lambda: cpu_ops.silu_and_mul(wide[:, : 2 * 344]),
        "rms_norm": lambda: cpu_ops.rms_norm(x, w, 1e-5),
        "fused_add_rms_norm": lambda: cpu_ops.fused_add_rms_norm(x, res, w, 1e-5),
        "rotary_embedding": lambda: cpu_ops.rotary_embedding(qk, cos, sin),
        "argmax_rows": lambda: cpu_ops.argmax_rows(wide),
    }


@pytest.mark.parametrize(
    "op",
    [
        "linear_one_row",
        "linear_one_row_bf16",
        "linear_few_rows",
        "linear_few_rows_bf16",
        "silu_and_mul",
        "rms_norm",
        "fused_add_rms_norm",
        "rotary_embedding",
        "argmax_rows",
    ],
)
def test_row_wise_operators_give_the_same_bits_on_any_number_of_threads(
    cpu_ops: object, op: str, restore_threads: None
) -> None:
    run = _ops(cpu_ops)[op]
    torch.set_num_threads(1)
    want = run()
    results = []
    for n in (2, 3):
        torch.set_num_threads(n)
        results.append(run())
    for got in results:
        for a, b in zip(
            want if isinstance(want, tuple) else (want,),
            got if isinstance(got, tuple) else (got,),
            strict=True,
        ):
            assert torch.equal(a, b)


@pytest.mark.parametrize("vocab", [1, 7, 8, 16, 17, 512, 32000, 151936])
def test_the_argmax_operator_gives_torchs_first_maximum(cpu_ops: object, vocab: int) -> None:
    """Random rows, rows of a few distinct values (many ties: the first one wins), rows
    all equal, infinities, zeros of both signs, a strided view: torch's max(dim) indices.
    Covers a row shorter than a vector, whole vectors, and a partial last vector."""
    gen = torch.Generator().manual_seed(vocab)
    rows = [
        torch.randn(5, vocab, generator=gen),
        torch.randint(0, 3, (5, vocab), generator=gen).float(),
        torch.full((2, vocab), -3.0),
        torch.full((2, vocab), float("-inf")),
    ]
    mixed = torch.randn(4, vocab, generator=gen)
    mixed[0, vocab // 2] = float("inf")
    mixed[1, :] = 0.0
    mixed[1, torch.arange(vocab - 1, -1, -3)] = -0.0
    mixed[2, :] = float("-inf")
    mixed[2, vocab - 1] = -1e30
    rows.append(mixed)
    wide = torch.randn(6, vocab + 5, generator=gen)
    rows.append(wide[:, 3 : 3 + vocab])  # rows vocab + 5 apart, at an offset
    for x in rows:
        got = cpu_ops.argmax_rows(x)
        assert got.dtype == torch.long and got.shape == (x.shape[0],)
        assert torch.equal(got, x.max(dim=-1).indices), x


@pytest.mark.parametrize("vocab", [5, 512, 1001])
def test_the_argmax_operator_takes_the_first_nan_as_torch_does(cpu_ops: object, vocab: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, vocab, generator=gen)
    x[0, vocab - 1] = float("nan")
    x[1, 2] = float("nan")
    x[1, vocab - 2] = float("nan")
    x[2, :] = float("nan")
    x[3, vocab // 2] = float("inf")
    x[3, vocab // 2 + 1] = float("nan")
    assert torch.equal(cpu_ops.argmax_rows(x), x.max(dim=-1).indices)
    assert cpu_ops.argmax_rows(x).tolist() == [vocab - 1, 2, 0, vocab // 2 + 1]


def test_the_argmax_operator_refuses_other_dtypes_and_empty_rows(cpu_ops: object) -> None:
    with pytest.raises(RuntimeError, match="argmax_rows"):
        cpu_ops.argmax_rows(torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        cpu_ops.argmax_rows(torch.randn(2, 0))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        cpu_ops.argmax_rows(torch.randn(2, 8).t())


@pytest.mark.parametrize("k", [1, 7, 16, 344, 4864])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 1001])
def test_the_batch_1_projection_is_as_exact_as_blas(cpu_ops: object, k: int, n: int) -> None:
    """Against a float64 product: no further from it than four times BLAS's error (the
    sums run in another order), bias included."""
    gen = torch.Generator().manual_seed(k * 7 + n)
    x, w, b = (
        torch.randn(1, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
    )
    exact = x.double() @ w.double().t() + b.double()
    ours = (cpu_ops.linear_one_row(x, w, b).double() - exact).abs().max().item()
    blas = ((torch.addmm(b, x, w.t())).double() - exact).abs().max().item()
    assert ours <= 4 * blas + 1e-5


# In a child process (the operator reads DECODEGRAPH_CPU_WEIGHTS_AHEAD once per process):
# float32 batch-1 projections over rows of several lengths, as exact as BLAS, saved.
_WEIGHTS_AHEAD = """
import sys, torch
from decodegraph.native import load_cpu_ops
ops, outs = load_cpu_ops(), []
for n, k in [(1001, 7), (1001, 344), (3, 4864), (257, 4865)]:
    gen = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    exact = x.double() @ w.double().t()
    err = (ops.linear_one_row(x, w, None).double() - exact).abs().max().item()
    assert err <= 4 * (torch.mm(x, w.t()).double() - exact).abs().max().item() + 1e-5
    outs.append(ops.linear_one_row(x, w, None))
for n, k in [(1001, 344), (257, 4865), (130, 70)]:
    gen = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen).bfloat16()
    outs.append(ops.linear_one_row(x.bfloat16(), w.bfloat16(), b))
torch.save(outs, sys.argv[1])
"""


def test_fetching_the_weights_ahead_or_not_gives_the_same_bits(
    cpu_ops: object,
    tmp_path,  # noqa: ANN001
) -> None:
    off, on = outputs_under_settings(
        "import os; os.environ['DECODEGRAPH_CPU_ROWS_SIDE_BY_SIDE'] = '0'\n" + _WEIGHTS_AHEAD,
        "DECODEGRAPH_CPU_WEIGHTS_AHEAD",
        tmp_path,
    )
    assert all(torch.equal(a, b) for a, b in zip(off, on, strict=True))


def test_rows_side_by_side_or_one_at_a_time_give_the_same_bits(
    cpu_ops: object,
    tmp_path,  # noqa: ANN001
) -> None:
    """Rows read side by side, far apart (float32: six with 16-lane vectors, three with
    8-lane ones; bfloat16: four or two), against one row after another: each row summed
    in the same order, rows left over (n = 1001, 3, 257, 130 are not multiples of them)
    included."""
    off, on = outputs_under_settings(_WEIGHTS_AHEAD, "DECODEGRAPH_CPU_ROWS_SIDE_BY_SIDE", tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(off, on, strict=True))


@pytest.mark.parametrize("k", [1, 7, 16, 33, 40, 344, 345, 4864, 4865])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 1001])
def test_the_bf16_batch_1_projection_is_as_exact_as_torch_mm(
    cpu_ops: object, k: int, n: int
) -> None:
    """bfloat16 x, weight and bias, summed in float32 and rounded once to bfloat16 (the
    activation's dtype): against a float64 product of the same bf16 values, within half a
    bf16 step plus the float32 sums' error of every output, and never further from it
    than torch.mm's bf16 addmm."""
    gen = torch.Generator().manual_seed(k * 11 + n)
    x, w, b = (
        torch.randn(1, k, generator=gen).bfloat16(),
        torch.randn(n, k, generator=gen).bfloat16(),
        torch.randn(n, generator=gen).bfloat16(),
    )
    exact = x.double() @ w.double().t() + b.double()
    got = cpu_ops.linear_one_row(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (1, n)
    err = (got.double() - exact).abs()
    # float32 sums of k + 1 terms: at most (k + 1) units of 2^-24 of the sum of |terms|
    # (the bf16 products are exact in float32), then one rounding to 8 significant bits.
    sums = (k + 1) * 2.0**-24 * (x.double().abs() @ w.double().abs().t() + b.double().abs())
    _, exponent = torch.frexp(exact.abs() + sums)
    half_step = torch.pow(2.0, exponent.double() - 9)
    assert (err <= half_step + sums).all()
    torch_err = (torch.addmm(b, x, w.t()).double() - exact).abs().max().item()
    assert err.max().item() <= torch_err + sums.max().item()
    assert torch.equal(cpu_ops.linear_one_row(x, w, None), cpu_ops.linear_one_row(x, w, b * 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batch_1_projection_of_a_view_at_any_offset(
    cpu_ops: object, dtype: torch.dtype
) -> None:
    """x may start anywhere in its storage (a bf16 x is widened into a buffer of the op's
    own, on a 64-byte boundary; a float32 one is read where it lies): the same bits as a
    fresh copy of it, at every offset."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(37, 344, generator=gen).to(dtype)
    row = torch.randn(1, 344 + 16, generator=gen).to(dtype)
    for offset in range(16):
        x = row[:, offset : offset + 344]
        assert x.data_ptr() % 64 == (offset * x.element_size()) % 64
        assert torch.equal(
            cpu_ops.linear_one_row(x, w, None), cpu_ops.linear_one_row(x.clone(), w, None)
        )


def test_the_batch_1_projection_refuses_mixed_dtypes_and_more_rows(cpu_ops: object) -> None:
    w = torch.randn(8, 16)
    for args in (
        (torch.randn(2, 16), w, None),  # one row only
        (torch.randn(1, 16), w.bfloat16(), None),  # x and weight of one dtype
        (torch.randn(1, 16).bfloat16(), w.bfloat16(), torch.randn(8)),  # and the bias too
        (torch.randn(1, 16).half(), w.half(), None),  # float32 or bfloat16 only
    ):
        with pytest.raises(RuntimeError, match="linear_one_row"):
            cpu_ops.linear_one_row(*args)


@pytest.mark.parametrize("m", [2, 3, 5, 8])
@pytest.mark.parametrize("k", [7, 16, 344, 4865])
@pytest.mark.parametrize("n", [1, 3, 5, 1001])
def test_the_few_rows_product_is_as_exact_as_blas(cpu_ops: object, m: int, k: int, n: int) -> None:
    """Against a float64 product: no further from it than four times BLAS's error, bias
    included, for every row count, weight row count (whole groups of rows and the rest)
    and length (whole vectors and a tail)."""
    gen = torch.Generator().manual_seed(m * 1000 + k * 7 + n)
    x, w, b = (
        torch.randn(m, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
    )
    exact = x.double() @ w.double().t() + b.double()
    got = cpu_ops.linear_few_rows(x, w, b)
    assert got.shape == (m, n)
    ours = (got.double() - exact).abs().max().item()
    blas = (torch.addmm(b, x, w.t()).double() - exact).abs().max().item()
    assert ours <= 4 * blas + 1e-5


@pytest.mark.parametrize("m", [2, 3, 5, 8])
@pytest.mark.parametrize("k", [7, 33, 344, 4865])
@pytest.mark.parametrize("n", [1, 5, 1001])
def test_the_bf16_few_rows_product_is_as_exact_as_torch_mm(
    cpu_ops: object, m: int, k: int, n: int
) -> None:
    """bfloat16 x, weight and bias, summed in float32 and rounded once: within half a bf16
    step plus the float32 sums' error of a float64 product of the same values, and never
    further from it than torch.mm's bf16 addmm (as the batch-1 product)."""
    gen = torch.Generator().manual_seed(m * 1000 + k * 11 + n)
    x, w, b = (
        torch.randn(m, k, generator=gen).bfloat16(),
        torch.randn(n, k, generator=gen).bfloat16(),
        torch.randn(n, generator=gen).bfloat16(),
    )
    exact = x.double() @ w.double().t() + b.double()
    got = cpu_ops.linear_few_rows(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = (got.double() - exact).abs()
    sums = (k + 1) * 2.0**-24 * (x.double().abs() @ w.double().abs().t() + b.double().abs())
    _, exponent = torch.frexp(exact.abs() + sums)
    assert (err <= torch.pow(2.0, exponent.double() - 9) + sums).all()
    torch_err = (torch.addmm(b, x, w.t()).double() - exact).abs().max().item()
    assert err.max().item() <= torch_err + sums.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_few_rows_product_does_not_depend_on_the_other_rows(
    cpu_ops: object, dtype: torch.dtype
) -> None:
    """Each output sums in an order set by k and the ISA alone: a decode batch padded to
    a graph's row count gives its rows the bits they get unpadded."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 344, generator=gen).to(dtype)
    w = torch.randn(1001, 344, generator=gen).to(dtype)
    full = cpu_ops.linear_few_rows(x, w, None)
    for m in range(2, 8):
        assert torch.equal(cpu_ops.linear_few_rows(x[:m], w, None), full[:m])


def test_the_few_rows_product_refuses_more_rows_and_other_dtypes(cpu_ops: object) -> None:
    w = torch.randn(8, 16)
    for args in (
        (torch.randn(9, 16), w, None),  # eight rows at most
        (torch.randn(2, 16).bfloat16(), w, None),  # x and weight of one dtype
        (torch.randn(2, 16).half(), w.half(), None),  # float32 or bfloat16 only
        (torch.randn(2, 16), w, torch.randn(7)),  # a bias per output
    ):
        with pytest.raises(RuntimeError, match="linear_few_rows"):
            cpu_ops.linear_few_rows(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_take_the_few_rows_product_for_small_batches_in_eager_steps_and_in_graphs(
    cpu_ops: object, dtype: torch.dtype
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    layer = _loaded_layer(dtype, 256, 384)
    gen = torch.Generator().manual_seed(0)
    # (Exactness against float64: the few-rows products' own tests.)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {}
    for m in (2, 4, 8):
        x = torch.randn(m, 256, generator=gen).to(dtype)
        assert torch.equal(layer(x), cpu_ops.linear_few_rows(x, layer.weight, layer.bias))
        torch.testing.assert_close(layer(x), _exact_linear(layer, x), **tol)
    assert any("linear_few_rows" in str(n.target) for n in make_fx(layer)(x).graph.nodes)
    nine = make_fx(layer)(torch.randn(9, 256).to(dtype)).graph.nodes
    assert not any("linear_few_rows" in str(n.target) for n in nine)  # more rows: mm
    assert _loaded_layer(dtype, 64, 96).few_rows is None  # under 64Ki values: mm
    assert _loaded_layer(torch.float16, 256, 384).few_rows is None  # float16: mm


def test_an_inductor_graph_calls_the_few_rows_product_through_its_c_shim(
    c_shims: object,
) -> None:
    layer = _loaded_layer(torch.float32, 256, 384)
    x = torch.randn(4, 256)
    graph, code = _compiled_with_platform_options(layer, [x])
    assert "aoti_torch_cpu_linear_few_rows(" in code
    assert "aoti_torch_call_dispatcher" not in code
    x.copy_(torch.randn(4, 256))
    assert torch.equal(graph.replay(), c_shims.linear_few_rows(x, layer.weight, layer.bias))


def _exact_linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's product in float64, rounded once to x's dtype: the reference. (torch's
    own bf16 addmm is not: on an aarch64 build it strayed up to 0.06 from this where our
    operators gave it exactly.)"""
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    return exact.to(x.dtype)


def _loaded_layer(dtype: torch.dtype, input_size: int, output_size: int) -> torch.nn.Module:
    from decodegraph.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(input_size, output_size, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_take_the_batch_1_projection_in_eager_steps_and_in_graphs(
    cpu_ops: object, dtype: torch.dtype
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    layer = _loaded_layer(dtype, 256, 384)  # over the size that keeps mm
    x1, x2 = torch.randn(1, 256, dtype=dtype), torch.randn(2, 256, dtype=dtype)
    assert torch.equal(layer(x1), cpu_ops.linear_one_row(x1, layer.weight, layer.bias))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(layer(x1), _exact_linear(layer, x1), **tol)
    traced = make_fx(layer)(x1).graph
    assert any("linear_one_row" in str(n.target) for n in traced.nodes)
    assert not any("linear_one_row" in str(n.target) for n in make_fx(layer)(x2).graph.nodes)
    assert _loaded_layer(dtype, 64, 96).one_row is None  # under 64Ki values: mm
    assert _loaded_layer(torch.float16, 256, 384).one_row is None  # float16: mm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_inductor_graph_calls_the_batch_1_projection_as_an_opaque_operator(
    c_shims: object, dtype: torch.dtype
) -> None:
    """With the CPU platform's Inductor options (its C++ wrapper): the compiled code calls
    the operator itself, as a C function (its C shim, not through the dispatcher), with
    the bits of an eager call, on the weights read at replay."""
    layer = _loaded_layer(dtype, 256, 384)
    x = torch.randn(1, 256, dtype=dtype)
    graph, code = _compiled_with_platform_options(layer, [x])
    assert "aoti_torch_cpu_linear_one_row(" in code
    assert "aoti_torch_call_dispatcher" not in code
    x.copy_(torch.randn(1, 256, dtype=dtype))
    with torch.no_grad():
        layer.weight.mul_(2)  # read at replay, not baked in
    assert torch.equal(graph.replay(), c_shims.linear_one_row(x, layer.weight, layer.bias))


def _compiled_with_platform_options(
    fn: Callable, inputs: list[torch.Tensor], decompositions: dict | None = None
) -> tuple[object, str]:
    """A CPU graph of fn over inputs, compiled with the CPU platform's Inductor options
    (its C++ wrapper, the operators' C shims), and the generated code."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    from decodegraph.config import CompilationConfig
    from decodegraph.platforms.cpu import CpuPlatform
    from decodegraph.platforms.cpu_graph import CpuGraph

    options = CpuPlatform().inductor_options(CompilationConfig())
    with fresh_cache():  # else a warm index loads the module and there is no code to read
        graph, code = run_and_get_code(
            lambda: CpuGraph("g", fn, inputs, True, options, decompositions)
        )
    return graph, "\n".join(code)


@pytest.mark.parametrize(
    ("windowed", "bound"), [(False, True), (True, True), (False, False)], ids=str
)
def test_an_inductor_graph_calls_the_attention_through_its_c_shim(
    c_shims: object, windowed: bool, bound: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C++ wrapper calls the attention (and the windowed, soft-capped one) as a C
    function, not through the dispatcher, with the bits of an eager call: one decode at
    position 17 over two blocks of 16, 8 query heads of 8 over 4 KV heads. When the
    operator refuses its arguments, the error names the call and gives the operator's
    own reason, through the bound entry and through the module's entry alike."""
    from decodegraph.platforms import cpu_graph

    if not bound:
        monkeypatch.setattr(cpu_graph, "bind_entry", lambda *args: None)
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(3, 4, 8, 16, generator=gen) for _ in range(2))
    meta = (
        torch.tensor([2 * 16 + 1]),  # slot 17 of blocks [2, 1]
        torch.tensor([[2, 1]], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([18], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
    )
    workspace = torch.zeros(1, 1024)
    extra = (8, 30.0) if windowed else ()
    op = c_shims.paged_attention_windowed_capped if windowed else c_shims.paged_attention

    def attend(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        k, v = kv[:, :32], kv[:, 32:]
        return op(q * 2, k, v, k_cache, v_cache, *meta, 0.35, workspace, *extra)

    q, kv = torch.randn(1, 64, generator=gen), torch.randn(1, 64, generator=gen)
    graph, code = _compiled_with_platform_options(attend, [q, kv])
    name = "paged_attention_windowed_capped" if windowed else "paged_attention"
    assert f"aoti_torch_cpu_{name}(" in code
    assert "aoti_torch_call_dispatcher" not in code
    q.copy_(torch.randn(1, 64, generator=gen))
    kv.copy_(torch.randn(1, 64, generator=gen))
    assert torch.equal(graph.replay(), attend(q, kv))
    meta[-1].fill_(5)  # more requests than the batch's tensors: the operator refuses
    failed = rf"aoti_torch_cpu_{name}\(.* API call failed at .*: paged_attention: 5 requests"
    with pytest.raises(RuntimeError, match=failed):
        graph.replay()
    meta[-1].fill_(1)  # the shim's failure left nothing behind
    assert torch.equal(graph.replay(), attend(q, kv))


def _norm_rotate_activate(cpu_ops: object, width: int) -> tuple[Callable, list[torch.Tensor]]:
    """Both norms, the rotation (heads of 64) and the activation over two tokens of
    `width` values each, and inputs for them."""
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, width, generator=gen), torch.randn(2, width, generator=gen)
    weight = torch.rand(width, generator=gen) + 0.5
    cos, sin = torch.rand(2, 1, 64, generator=gen), torch.rand(2, 1, 64, generator=gen)

    def block(x, residual, weight, cos, sin):  # noqa: ANN001, ANN202
        h, res = cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
        rotated = cpu_ops.rotary_embedding(h.view(2, -1, 64), cos, sin).view(2, width)
        gate_up = torch.cat([cpu_ops.rms_norm(res, weight, 1e-6), rotated], dim=-1)
        return cpu_ops.silu_and_mul(gate_up), res

    return block, [x, residual, weight, cos, sin]


def test_norms_and_activations_on_wide_rows_are_called_through_their_c_shims(
    c_shims: object,
) -> None:
    """From FUSE_IN_GRAPHS_BELOW values per token up, a trace keeps the norms, the
    rotation and the activation as operators, and the compiled graph calls each through
    its C shim (the fused norm's two outputs included), with an eager call's bits; on
    narrower rows the trace holds the aten ops they stand for, for Inductor to fuse."""
    from decodegraph import native
    from decodegraph.platforms.base import trace

    decompositions = native.decompositions()
    # (the activation's rows are twice as wide as the norms')
    narrow, narrow_inputs = _norm_rotate_activate(c_shims, native.FUSE_IN_GRAPHS_BELOW // 2 - 64)
    targets = {str(n.target) for n in trace(narrow, narrow_inputs, decompositions).graph.nodes}
    assert not any("decodegraph_cpu" in t for t in targets), targets

    block, inputs = _norm_rotate_activate(c_shims, native.FUSE_IN_GRAPHS_BELOW)
    graph, code = _compiled_with_platform_options(block, inputs, decompositions)
    for name in ("fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"):
        assert f"aoti_torch_cpu_{name}(" in code, name
    assert "aoti_torch_call_dispatcher" not in code
    inputs[0].copy_(torch.randn(inputs[0].shape))  # a replay reads what the inputs hold now
    for got, want in zip(graph.replay(), block(*inputs), strict=True):
        assert torch.equal(got, want)


def _projection_without_bias(cpu_ops: object) -> tuple[torch.Tensor, torch.Tensor, object, str]:
    """The batch-1 projection with no bias, as a graph compiled with the platform's
    options: its input, its weight, the graph and the generated code."""
    x, weight = torch.randn(1, 256), torch.randn(384, 256)

    def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return cpu_ops.linear_one_row(x, w, None)

    graph, code = _compiled_with_platform_options(project, [x, weight])
    return x, weight, graph, code


def test_the_batch_1_projections_c_shim_takes_an_absent_bias(c_shims: object) -> None:
    """An optional tensor reaches a shim as a null handle pointer."""
    x, weight, graph, code = _projection_without_bias(c_shims)
    assert "aoti_torch_cpu_linear_one_row(" in code
    assert torch.equal(graph.replay(), c_shims.linear_one_row(x, weight, None))


def test_the_shims_are_global_and_torchs_libraries_are_not(cpu_ops: object) -> None:
    """A library loaded after the operators finds the C shims in the global scope, and
    finds none of torch's own symbols there (its C API, its BLAS): those would take the
    place of a later library's own copies (a CTranslate2 with an MKL of its own)."""
    import ctypes

    from decodegraph import native

    assert native._shims_visible
    scope = ctypes.CDLL(None)  # the global scope, as a later library's lookups see it
    for name in native.C_SHIMS:
        assert hasattr(scope, f"aoti_torch_cpu_{name}")
    assert hasattr(ctypes.CDLL(torch._C.__file__), "aoti_torch_new_tensor_handle")
    assert not hasattr(scope, "aoti_torch_new_tensor_handle")


def test_where_inductors_graph_cache_cannot_key_the_shims_graphs_compile_without_it(
    c_shims: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shims' mapping is keyed by operator and goes into every graph's FX-cache key.
    A torch whose key maker cannot hash an operator (2.10: each compile then failed)
    keeps the shims and compiles with Inductor's FX graph cache off: the wrapper calls the
    shim, with the operator's bits."""
    from torch._inductor.codecache import FxGraphCachePickler

    from decodegraph import native
    from decodegraph.config import CompilationConfig
    from decodegraph.platforms.cpu import CpuPlatform

    def refuse(self: object, obj: object) -> bytes:
        raise RuntimeError("<pybind11 function record> is not pickleable.")

    # As this torch stands (2.13: it can; 2.10: it cannot, and the cache is off already).
    stands = CpuPlatform().inductor_options(CompilationConfig())
    assert ("fx_graph_cache" in stands) is not native.graph_cache_hashes_operators()
    monkeypatch.setattr(FxGraphCachePickler, "dumps", refuse)
    native.graph_cache_hashes_operators.cache_clear()
    try:
        assert native.graph_cache_hashes_operators() is False  # kept for the process
        monkeypatch.undo()
        options = CpuPlatform().inductor_options(CompilationConfig())
        assert options["fx_graph_cache"] is False and options["aot_inductor.custom_ops_to_c_shims"]
        x, weight, graph, code = _projection_without_bias(c_shims)
        assert "aoti_torch_cpu_linear_one_row(" in code
    finally:
        native.graph_cache_hashes_operators.cache_clear()
    assert torch.equal(graph.replay(), c_shims.linear_one_row(x, weight, None))


def test_where_the_shims_cannot_be_made_visible_graphs_call_the_dispatcher(
    cpu_ops: object, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    """A library that cannot be made global (here: not loaded) leaves the shims out of
    the options, and a graph calls the operator through the dispatcher, with its bits."""
    from decodegraph import native

    monkeypatch.setattr(native, "_shims_visible", False)
    native._make_shims_visible(tmp_path / "not_loaded.so")
    assert native._shims_visible is False
    assert native.c_shims() == {}
    x, weight, graph, code = _projection_without_bias(cpu_ops)
    assert 'aoti_torch_call_dispatcher("decodegraph_cpu::linear_one_row"' in code
    assert torch.equal(graph.replay(), cpu_ops.linear_one_row(x, weight, None))
