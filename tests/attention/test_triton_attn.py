"""The Triton backend's kernels (CUDA's attention), checked on CPU by Triton's interpreter.

`triton.jit` decides at decoration time whether a kernel runs compiled or interpreted,
so the cases run in a child pytest whose environment sets TRITON_INTERPRET=1 before
anything imports the kernels: in that child this module defines the cases; in the
normal run it defines the one test that starts the child. On CPU machines triton is not
in the venv but in the repository's .triton/ (`make setup`, requirements-triton.txt),
which only that child gets on its PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decodegraph.attention.backends.base import AttentionCGSupport
from tests.utils.requests import greedy

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DIR = Path(__file__).resolve().parents[2] / ".triton"

if not INTERPRETED:

    def test_triton_kernels_in_the_interpreter() -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        if importlib.util.find_spec("triton") is None:
            if not (TRITON_DIR / "triton").is_dir():
                pytest.skip("triton is neither installed nor in .triton/ (run `make setup`)")
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(TRITON_DIR), env.get("PYTHONPATH", "")) if p
            )
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]

else:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from decodegraph.attention.backends.triton_attn import TritonAttentionBackend
    from tests.attention.test_torch_paged import (
        GQA,
        _assert_only_slots_written,
        check,
        make_backend,
        make_case,
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

    def test_a_mixed_batch_of_prefills_and_decodes() -> None:
        case = make_case(make_backend("triton", 4, 2), [(0, 5), (9, 1), (3, 4), (20, 1)])
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
        graphs; greedy ids equal the CPU backend's eager ones."""
        from decodegraph.entrypoints.llm import LLM

        params = greedy(6)
        prompts = [[1, 30], [1, 31, 32], [1]]
        monkeypatch.setenv("DECODEGRAPH_ATTENTION_BACKEND", "CPU_TORCH")
        eager = LLM(str(stories_dir), max_num_seqs=4, enforce_eager=True)
        expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
        monkeypatch.setenv("DECODEGRAPH_ATTENTION_BACKEND", "TRITON_ATTN")
        llm = LLM(
            str(stories_dir),
            max_num_seqs=4,
            compilation_config={"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [4, 8]},
        )
        runner = llm.llm_engine.runner
        assert runner.attn_backend.name == "TRITON_ATTN" and runner.graph_runner.mode.name == "FULL"
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        assert runner.graph_runner.mode_counts[("mixed", "FULL")] >= 1
        assert runner.graph_runner.mode_counts[("decode", "FULL")] >= 1
