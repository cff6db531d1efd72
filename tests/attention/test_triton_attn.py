"""The Triton backend's kernels (CUDA's attention), checked on CPU by Triton's interpreter.

`triton.jit` decides at decoration time whether a kernel runs compiled or interpreted,
so the cases run in a child pytest whose environment sets TRITON_INTERPRET=1 before
anything imports the kernels: in that child this module defines the cases; in the
normal run it defines the one test that starts the child. On CPU machines triton is not
in the venv but in the repository's .triton/ (`make setup`, requirements-triton.txt),
which only that child gets on its PYTHONPATH.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decodegraph.attention.backends.base import AttentionCGSupport
from tests.utils.requests import greedy
from tests.utils.triton import INTERPRETED, run_interpreted

if not INTERPRETED:

    def test_triton_kernels_in_the_interpreter() -> None:
        run_interpreted(__file__)

else:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from decodegraph.attention.backends import triton_attn
    from decodegraph.attention.backends.triton_attn import MAX_SEGMENTS, TritonAttentionBackend
    from decodegraph.forward_context import EAGER_PARAMS_ID, ForwardContext, set_forward_context
    from tests.attention.test_torch_paged import (
        GQA,
        MAX_NUM_REQS,
        Case,
        _assert_only_slots_written,
        check,
        make_backend,
        make_case,
        reference,
        run,
        token_slots,
    )

    Handle = interpreter.TensorHandle
    _interpreted_dot = interpreter.InterpreterBuilder.create_dot

    def _dot_of_bfloat16_values(
        self: interpreter.InterpreterBuilder, a: Handle, b: Handle, d: Handle, *precision: object
    ) -> Handle:
        """The interpreter keeps bfloat16 as its uint16 bits and its tl.dot multiplies
        those bits (triton-lang/triton#11584, not supported upstream): give it the float32
        values instead, which is what the GPU's bf16 MMA multiplies (exactly) too."""

        def values(x: Handle) -> Handle:
            if x.dtype.scalar != tl.bfloat16:
                return x
            bits = x.data.astype(np.uint32) << 16
            return Handle(bits.view(np.float32), tl.float32)

        return _interpreted_dot(self, values(a), values(b), d, *precision)

    @pytest.fixture(autouse=True)
    def _interpreter_bfloat16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", _dot_of_bfloat16_values)

    # Where a Triton release has no such internals, the interpreter runs as it is.
    _patch_lang = getattr(interpreter, "_patch_lang", None)

    def _patch_lang_once_per_run(fn: object) -> object:
        """Triton's interpreter patches `triton.language` again at every call of a nested
        @triton.jit function, though the kernel's run patched that module's language
        already: most of the interpreter's overhead in these tests (docs/performance.md).
        Patch once per module per kernel run; the run's own scope restores it at its
        end."""
        key = id(fn.__globals__)  # type: ignore[attr-defined]
        if key in _patched_this_run:
            return None  # a nested call discards its scope
        scope = _patch_lang(fn)
        _patched_this_run.add(key)
        return scope

    _patched_this_run: set[int] = set()
    _grid_executor = getattr(interpreter, "GridExecutor", None)
    _run_grid = None if _grid_executor is None else _grid_executor.__call__

    def _run_grid_patching_once(self: object, *args: object, **kwargs: object) -> object:
        _patched_this_run.clear()
        try:
            return _run_grid(self, *args, **kwargs)
        finally:
            _patched_this_run.clear()

    @pytest.fixture(autouse=True)
    def _lang_patched_once_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
        if _patch_lang is None or _run_grid is None:
            return
        monkeypatch.setattr(interpreter, "_patch_lang", _patch_lang_once_per_run)
        monkeypatch.setattr(interpreter.GridExecutor, "__call__", _run_grid_patching_once)

    @pytest.fixture(autouse=True)
    def _few_segments(monkeypatch: pytest.MonkeyPatch) -> None:
        """At most 4 segments unless a test asks for more: the interpreter runs programs
        one after another, so the empty segments of short contexts cost it dearly."""
        monkeypatch.setattr(TritonAttentionBackend, "max_segments", 4)

    def test_declares_full_graphs_for_every_batch() -> None:
        assert TritonAttentionBackend.cudagraph_support is AttentionCGSupport.ALWAYS

    @pytest.mark.parametrize("num_heads, num_kv_heads", GQA, ids=str)
    def test_prefill_is_causal(num_heads: int, num_kv_heads: int) -> None:
        case = make_case(make_backend("triton", num_heads, num_kv_heads), [(0, 7)])
        check(case, run(case))

    @pytest.mark.parametrize("context, chunk", [(5, 6), (4, 4), (12, 20)])
    def test_chunked_prefill_attends_over_the_context_offset(context: int, chunk: int) -> None:
        case = make_case(make_backend("triton", 4, 2), [(context, chunk)])
        check(case, run(case))

    @pytest.mark.parametrize("num_heads, num_kv_heads", GQA, ids=str)
    @pytest.mark.parametrize("lengths", [[1], [32], [1, 5, 13, 9], [32, 2, 17]], ids=str)
    def test_decode_batch_with_different_lengths(
        num_heads: int, num_kv_heads: int, lengths: list[int]
    ) -> None:
        backend = make_backend("triton", num_heads, num_kv_heads)
        case = make_case(backend, [(n - 1, 1) for n in lengths])
        check(case, run(case))

    @pytest.mark.parametrize("head_size", [8, 24, 64])
    def test_decode_at_the_default_block_size(head_size: int) -> None:
        """Block size 16; head sizes that are and are not powers of two (Qwen3-style)."""
        backend = make_backend("triton", 8, 2, head_size, block_size=16, max_model_len=128)
        case = make_case(backend, [(n - 1, 1) for n in [1, 17, 33, 100]])
        check(case, run(case))

    @pytest.mark.parametrize("segments", [1, 4])
    def test_a_mixed_batch_of_prefills_and_decodes(segments: int) -> None:
        backend = make_backend("triton", 4, 2)
        backend.max_segments = segments
        case = make_case(backend, [(0, 5), (9, 1), (3, 4), (20, 1)])
        assert backend._segments(case.query.shape[0]) == segments
        check(case, run(case))

    @pytest.mark.parametrize(
        "reqs, pad_reqs", [([(4, 1), (9, 1), (0, 1)], 1), ([(2, 1), (5, 1)], 6)], ids=str
    )
    def test_padded_decode_rows_write_no_kv_and_output_zeros(
        reqs: list[tuple[int, int]], pad_reqs: int
    ) -> None:
        backend = make_backend("triton")
        case = make_case(backend, reqs, pad_tokens=pad_reqs, pad_reqs=pad_reqs)
        before = [t.clone() for pair in backend.kv_caches for t in pair]
        out = run(case)
        check(case, out)
        assert not out[case.metadata.num_actual_tokens :].any()
        _assert_only_slots_written(backend, before, case.slots)

    def test_padded_mixed_rows_write_no_kv() -> None:
        """A mixed graph's padded tokens: query_start_loc's tail holds the real count."""
        backend = make_backend("triton")
        case = make_case(backend, [(3, 4), (0, 2)], pad_tokens=3, pad_reqs=2)
        before = [t.clone() for pair in backend.kv_caches for t in pair]
        out = run(case)
        check(case, out)
        assert torch.isfinite(out).all() and not out[case.metadata.num_actual_tokens :].any()
        _assert_only_slots_written(backend, before, case.slots)

    def test_kv_of_the_new_tokens_lands_in_their_slots() -> None:
        backend = make_backend("triton")
        case = make_case(backend, [(2, 3), (0, 1)])
        run(case)
        k_tokens, v_tokens = token_slots(backend, 0)
        n, kvh, d = case.metadata.num_actual_tokens, backend.num_kv_heads, backend.head_size
        slots = torch.tensor(case.slots)
        torch.testing.assert_close(k_tokens[slots], case.key[:n].view(n, kvh, d))
        torch.testing.assert_close(v_tokens[slots], case.value[:n].view(n, kvh, d))

    def test_half_precision_caches() -> None:
        """bfloat16 caches and inputs, float32 accumulation: close to the fp32 reference."""
        backend = make_backend("triton", 4, 2)
        backend.bind_kv_caches([(k.bfloat16(), v.bfloat16()) for k, v in backend.kv_caches])
        case = make_case(backend, [(6, 1), (0, 3)])
        for name in ("query", "key", "value"):
            setattr(case, name, getattr(case, name).bfloat16())
        out = run(case).float()
        n = case.metadata.num_actual_tokens
        torch.testing.assert_close(out[:n], case.expected, rtol=3e-2, atol=3e-2)

    @pytest.mark.parametrize("window", [5, 16])
    def test_a_sliding_window_sees_the_last_w_positions(window: int) -> None:
        backend = make_backend("triton", 8, 2, 16, 16, 128, sliding_window=window, num_blocks=64)
        case = make_case(backend, [(40, 1), (0, 30), (20, 7), (3, 1)])
        check(case, run(case))

    def test_logit_soft_capping_with_a_window() -> None:
        backend = make_backend("triton", 8, 4, 8, 16, 64, sliding_window=10, logits_soft_cap=3.0)
        case = make_case(backend, [(40, 1), (0, 30), (20, 7)], key_scale=3.0)
        check(case, run(case))

    def test_full_graphs_of_mixed_and_decode_batches_match_the_cpu_backend(
        stories_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The engine on TRITON_ATTN (interpreted), mode FULL: the first step is a mixed
        batch that fits a graph (a prefill beside decodes, padded), then padded decode
        graphs; greedy ids equal the CPU backend's eager ones. Two segments: every graph
        splits (and the interpreter pays for no more programs than that needs). The
        graphs replay their traces as they are: Inductor's compiles of them (a device's
        graphs have none) took most of this test's time."""
        from decodegraph.entrypoints.llm import LLM

        monkeypatch.setattr(TritonAttentionBackend, "max_segments", 2)

        params = greedy(6)
        prompts = [[1, 30], [1, 31, 32], [1]]
        monkeypatch.setenv("DECODEGRAPH_ATTENTION_BACKEND", "CPU_TORCH")
        eager = LLM(str(stories_dir), max_num_seqs=4, enforce_eager=True)
        expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
        monkeypatch.setenv("DECODEGRAPH_ATTENTION_BACKEND", "TRITON_ATTN")
        llm = LLM(
            str(stories_dir),
            max_num_seqs=4,
            compilation_config={
                "cudagraph_mode": "FULL",
                "cudagraph_capture_sizes": [4, 8],
                "use_inductor": False,
            },
        )
        runner = llm.llm_engine.runner
        assert runner.attn_backend.name == "TRITON_ATTN" and runner.graph_runner.mode.name == "FULL"
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        assert runner.graph_runner.mode_counts[("mixed", "FULL")] >= 1
        assert runner.graph_runner.mode_counts[("decode", "FULL")] >= 1

    # ------------------------------------------------------------ real contexts
    # Contexts up to 8k positions: few requests and one or two KV heads each, since the
    # interpreter runs one program after another (a tile costs it milliseconds).

    LONG = 8192

    def long_case(
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        reqs: list[tuple[int, int]],
        dtype: torch.dtype = torch.float32,
        segments: int = MAX_SEGMENTS,
        pad: int = 0,
        **options: object,
    ) -> Case:
        """A case over a cache just large enough for `reqs`, at most `segments` per
        context, keys 3x standard normal (peaked attention: outputs far from the mean);
        bfloat16 caches and q/k/v when `dtype` says so."""
        blocks = sum(-(-(c + n) // block_size) for c, n in reqs) + 1
        backend = make_backend(
            "triton",
            num_heads,
            num_kv_heads,
            head_size,
            block_size,
            LONG,
            num_blocks=blocks,
            **options,
        )
        backend.max_segments = segments
        if dtype != torch.float32:
            backend.bind_kv_caches([(k.to(dtype), v.to(dtype)) for k, v in backend.kv_caches])
        backend.allocate_workspace(MAX_NUM_REQS, dtype, torch.device("cpu"))
        case = make_case(backend, reqs, pad_tokens=pad, pad_reqs=pad, key_scale=3.0)
        for name in ("query", "key", "value"):
            setattr(case, name, getattr(case, name).to(dtype))
        return case

    def check_against_the_cache(case: Case, out: torch.Tensor) -> None:
        """Against the dense reference over the values the kernels read: the cache's
        (bfloat16-rounded) K/V after the step and the query as given."""
        backend, md = case.backend, case.metadata
        if out.dtype == torch.float32:
            check(case, out)
            return
        k_tokens, v_tokens = token_slots(backend, 0)
        bs, h, d = backend.block_size, backend.num_heads, backend.head_size
        expected = []
        for i in range(md.num_reqs):
            start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
            length = md.seq_lens_cpu[i]
            pos = torch.arange(length)
            slots = md.block_tables[i, pos // bs].long() * bs + pos % bs
            q = case.query[start:end].float().view(end - start, h, d)
            expected.append(
                reference(
                    q,
                    k_tokens[slots].float(),
                    v_tokens[slots].float(),
                    length - (end - start),
                    backend.scale,
                    backend.sliding_window,
                    backend.logits_soft_cap,
                )
            )
        n = md.num_actual_tokens
        torch.testing.assert_close(out[:n].float(), torch.cat(expected), rtol=1e-2, atol=1e-2)

    @pytest.mark.parametrize(
        "dtype, num_heads, num_kv_heads, head_size, block_size, lengths",
        [
            (torch.float32, 8, 1, 128, 16, [LONG, 1000, 17]),  # GQA 8
            (torch.bfloat16, 4, 1, 64, 32, [LONG, 300]),  # GQA 4
            (torch.float32, 2, 2, 64, 32, [4096, 5]),  # GQA 1
        ],
        ids=["fp32-h128-b16-gqa8", "bf16-h64-b32-gqa4", "fp32-h64-b32-gqa1"],
    )
    def test_a_long_decode_split_over_segments_matches_the_reference(
        dtype: torch.dtype,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        lengths: list[int],
    ) -> None:
        case = long_case(
            num_heads, num_kv_heads, head_size, block_size, [(n - 1, 1) for n in lengths], dtype
        )
        backend = case.backend
        assert backend._segments(len(lengths)) == MAX_SEGMENTS  # the split path
        check_against_the_cache(case, run(case))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_a_long_decode_unsplit_matches_the_reference(dtype: torch.dtype) -> None:
        """One segment (what large batches get): the decode kernel writes the output."""
        case = long_case(4, 1, 128, 16, [(4095, 1), (40, 1)], dtype, segments=1)
        assert case.backend._segments(2) == 1
        check_against_the_cache(case, run(case))

    @pytest.mark.parametrize(
        "dtype, head_size, block_size, reqs, segments",
        [
            (torch.bfloat16, 128, 32, [(3000, 24), (LONG - 1, 1), (0, 40), (1500, 1)], 2),
            (torch.float32, 64, 16, [(1500, 24), (4095, 1), (0, 40), (700, 1)], 1),
        ],
        ids=["bf16-h128-b32-split", "fp32-h64-b16-unsplit"],
    )
    def test_a_long_mixed_batch_matches_the_reference(
        dtype: torch.dtype,
        head_size: int,
        block_size: int,
        reqs: list[tuple[int, int]],
        segments: int,
    ) -> None:
        """Prefill tiles of several tokens x a group of 8 heads beside long decodes: a
        chunk deep into its context, a prompt, decodes; split (66 tokens on one KV head
        get 2 segments) and not."""
        case = long_case(8, 1, head_size, block_size, reqs, dtype, segments=segments)
        assert not case.metadata.uniform_decode
        assert case.backend._segments(case.query.shape[0]) == segments
        check_against_the_cache(case, run(case))

    @pytest.mark.parametrize(
        "dtype, reqs",
        [
            (torch.bfloat16, [(LONG - 1, 1), (599, 1)]),
            (torch.bfloat16, [(5000, 20), (0, 30), (7000, 1)]),
            (torch.float32, [(LONG - 1, 1), (1200, 1)]),
        ],
        ids=["bf16-decode", "bf16-mixed", "fp32-decode"],
    )
    def test_a_sliding_window_with_soft_capping_at_long_contexts(
        dtype: torch.dtype, reqs: list[tuple[int, int]]
    ) -> None:
        """Gemma's attention: a window of 1000 positions (the segments split the window,
        not the context) and scores capped at 50."""
        options = dict(sliding_window=1000, logits_soft_cap=50.0)
        case = long_case(2, 1, 128, 16, reqs, dtype, **options)
        check_against_the_cache(case, run(case))

    def test_a_window_without_a_cap_over_a_split_decode() -> None:
        case = long_case(8, 1, 64, 32, [(LONG - 1, 1), (4200, 1)], sliding_window=4096)
        check(case, run(case))

    @pytest.mark.parametrize("block_size", [64, 128])
    def test_tiles_within_larger_blocks(block_size: int) -> None:
        """Blocks of several tiles (a tile is 32 positions of one block): decodes and a
        mixed batch across block and tile boundaries."""
        decodes = long_case(4, 1, 64, block_size, [(n - 1, 1) for n in (300, 129, 32)], segments=8)
        check(decodes, run(decodes))
        mixed = long_case(4, 1, 64, block_size, [(200, 20), (0, 9), (127, 1)], segments=8)
        check(mixed, run(mixed))

    def _run_into(case: Case, output: torch.Tensor) -> torch.Tensor:
        case.backend.set_eager_metadata(case.metadata)
        with set_forward_context(ForwardContext(case.backend, EAGER_PARAMS_ID)):
            torch.ops.decodegraph.unified_attention_with_output(
                case.query, case.key, case.value, output, 0, EAGER_PARAMS_ID
            )
        return output

    @pytest.mark.parametrize(
        "reqs, pad", [([(700, 1), (30, 1)], 2), ([(200, 9), (0, 3), (64, 1)], 5)], ids=str
    )
    def test_padded_rows_output_zeros_over_any_previous_contents(
        reqs: list[tuple[int, int]], pad: int
    ) -> None:
        """Padded rows (a split decode; a mixed batch) of an output that held NaN: zero,
        and the real rows right."""
        case = long_case(4, 1, 64, 16, reqs, segments=8, pad=pad)
        assert case.backend._segments(case.query.shape[0]) > 1
        out = _run_into(case, torch.full_like(case.query, float("nan")))
        check(case, out)
        assert torch.equal(out[case.metadata.num_actual_tokens :], torch.zeros_like(out[-pad:]))

    @pytest.mark.parametrize("uniform", [True, False], ids=["decode", "mixed"])
    def test_the_kernels_read_no_host_metadata(uniform: bool) -> None:
        """A graph's host values stay what its capture saw (nothing refreshes them for
        this backend): with every host field of the metadata from another batch, the
        device tensors alone still give this batch's attention."""
        reqs = [(900, 1), (301, 1), (0, 1)] if uniform else [(900, 1), (20, 7), (0, 3)]
        case = long_case(4, 1, 64, 16, reqs, segments=8, pad=1)
        md = case.metadata
        md.num_reqs, md.max_query_len, md.max_seq_len = 1, 1, 1
        md.query_start_loc_cpu, md.seq_lens_cpu = [0, 1], [1]
        # New tensors: on CPU the host copies may be the device tensors themselves.
        md.seq_lens_host = torch.ones_like(md.seq_lens)
        md.query_start_loc_host = torch.zeros_like(md.query_start_loc)
        md.num_reqs_host = torch.ones(1, dtype=torch.int32)
        md._host_arrays = None
        out = run(case)
        assert torch.equal(out[md.num_actual_tokens :], torch.zeros_like(out[-1:]))
        md.num_reqs = len(reqs)
        md.query_start_loc_cpu = [0]
        for _, n in reqs:
            md.query_start_loc_cpu.append(md.query_start_loc_cpu[-1] + n)
        md.seq_lens_cpu = [c + n for c, n in reqs]
        check(case, out)

    def test_launch_grids_depend_on_the_padded_size_alone(monkeypatch: pytest.MonkeyPatch) -> None:
        """Two decode batches of one padded size, lengths 1 and 2k apart, and two mixed
        ones: the same kernels, grids and constants, as a captured graph replays them."""
        launches: list[tuple] = []

        class Recorded:
            def __init__(self, kernel: object) -> None:
                self.kernel = kernel

            def __getitem__(self, grid: tuple) -> object:
                def launch(*args: object, **constants: object) -> None:
                    launches.append((self.kernel, grid, tuple(sorted(constants.items()))))
                    self.kernel[grid](*args, **constants)

                return launch

        for name in ("_write_kv", "_decode_attention", "_reduce_segments", "_prefill_attention"):
            monkeypatch.setattr(triton_attn, name, Recorded(getattr(triton_attn, name)))
        seen = []
        for reqs in ([(0, 1), (1, 1), (2, 1)], [(2047, 1), (1000, 1), (9, 1)]):
            launches.clear()
            case = long_case(4, 1, 64, 32, reqs, segments=8, pad=1)
            check(case, run(case))
            seen.append(list(launches))
        for reqs in ([(0, 2), (0, 1)], [(1500, 2), (2047, 1)]):
            launches.clear()
            case = long_case(4, 1, 64, 32, reqs, segments=8, pad=2)
            check(case, run(case))
            seen.append(list(launches))
        assert seen[0] == seen[1] and seen[2] == seen[3]
        kernels = [[k for k, *_ in launches] for launches in seen]
        write, reduce = triton_attn._write_kv.kernel, triton_attn._reduce_segments.kernel
        assert kernels[0] == [write, triton_attn._decode_attention.kernel, reduce]
        assert kernels[2] == [write, triton_attn._prefill_attention.kernel, reduce]

    def test_segments_follow_the_padded_batch_and_fit_the_workspace() -> None:
        backend = make_backend("triton", 32, 8, 64, 16, LONG)
        backend.max_segments = MAX_SEGMENTS
        sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
        assert [backend.num_segments(n) for n in sizes] == [64, 32, 16, 8, 4, 2, 1, 1, 1]
        backend.allocate_workspace(256, torch.bfloat16, torch.device("cpu"))
        parts = (backend._part_acc, backend._part_m, backend._part_l)
        allocated = sum(t.numel() * t.element_size() for t in parts)
        assert allocated == backend.workspace_bytes(256, torch.bfloat16)
        assert all(backend._segments(n) == backend.num_segments(n) for n in range(1, 257))
        backend.set_eager_metadata(make_case(backend, [(0, 1)]).metadata)
        bound = backend.graph_tensors(EAGER_PARAMS_ID)
        assert all(any(t is b for b in bound) for t in parts)

    def test_the_kv_budget_reserves_megabytes_at_default_settings() -> None:
        """Llama-3.2-1B at vLLM's defaults (max_model_len 131072, 256 sequences): the
        budget once reserved a 64 GiB gather workspace this backend never allocates."""
        backend = TritonAttentionBackend(32, 8, 64, 0.125, 16, 131072)
        declared = backend.workspace_bytes(256, torch.bfloat16)
        # 512 programs over 8 KV heads: 64 (token, segment) rows of fp32 partials.
        assert declared == 4 * 64 * 32 * (64 + 2)
        assert declared == backend.workspace_bytes(1, torch.bfloat16) < 8 << 20
