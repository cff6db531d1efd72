"""The whole engine (paged KV cache, batched steps, sampler) against transformers'
`generate()` on the same saved checkpoints, for every architecture variant.

tests/models/test_llama.py compares the model alone (logits); here the ids come out
of `LLM.generate` with several prompts of different lengths batched together.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from decodegraph import LLM, SamplingParams
from tests.utils.checkpoints import CHECKPOINTS, make_checkpoint
from tests.utils.requests import greedy

# Different lengths: one token, inside one block, exactly one block, across blocks.
PROMPTS = [
    [1],
    [1, 17, 42, 99, 5, 63, 120, 7, 33, 88, 11],
    [1, *range(20, 35)],
    [1, *[(7 * i + 3) % 120 + 3 for i in range(36)]],
]
NUM_TOKENS = 40
TOP_LOGPROBS = 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine_ckpt")
    return {arch: make_checkpoint(root, arch) for arch in CHECKPOINTS}


def hf_generate(
    model: torch.nn.Module, prompt: list[int], num_tokens: int = NUM_TOKENS
) -> tuple[list[int], torch.Tensor]:
    """Greedy ids and the raw per-step log-probabilities ([num_tokens, vocab])."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ids = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return ids, logprobs


@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_batched_greedy_ids_and_logprobs_match_transformers_generate(
    arch: str, checkpoints: dict[str, Path]
) -> None:
    path = checkpoints[arch]
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=8,
        dtype="float32",
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref.generation_config.eos_token_id = None  # all NUM_TOKENS steps on both sides
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want_ids, want_logprobs = hf_generate(ref, prompt)
        completion = out.outputs[0]
        assert completion.token_ids == want_ids, f"prompt of {len(prompt)} tokens"
        assert completion.finish_reason == "length"
        assert len(completion.logprobs) == NUM_TOKENS
        for step, (tok, lps) in enumerate(zip(want_ids, completion.logprobs, strict=True)):
            assert lps[tok].rank == 1  # greedy: the sampled token is the most likely
            top = want_logprobs[step].topk(TOP_LOGPROBS)
            for lp, tid in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                assert lps[tid].logprob == pytest.approx(lp, abs=1e-4)
        total = want_logprobs[torch.arange(NUM_TOKENS), torch.tensor(want_ids)].sum().item()
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)


# Half precision: a random-weight model's next-token distribution is nearly flat, so
# two logits a rounding apart (or exactly tied in bf16) are common. As in vLLM's
# check_logprobs_close, greedy ids must agree up to the first step where transformers
# itself sees a near tie, and there our pick must be one of the tied tokens.
HALF_TIE = 0.05  # logprob gap; one bf16 ulp of a logit near 4 is 0.03


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_auto_reads_a_half_checkpoint_and_greedy_ids_match_transformers(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    path = make_checkpoint(tmp_path, "llama-gqa", dtype=dtype)
    llm = LLM(str(path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128)
    assert llm.llm_engine.runner.dtype == dtype
    params = greedy(24)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:3]], params, use_tqdm=False)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    ref.generation_config.eos_token_id = None
    ref.eval()
    for prompt, out in zip(PROMPTS[1:3], outs, strict=True):
        got = out.outputs[0].token_ids
        want, logprobs = hf_generate(ref, prompt, num_tokens=24)
        step = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if step is None:
            continue
        gap = (logprobs[step, want[step]] - logprobs[step, got[step]]).item()
        assert gap <= HALF_TIE, f"step {step}: {got[step]} vs {want[step]}, {gap:.4f} apart"


def test_a_window_shorter_than_the_context_matches_transformers_past_it(
    tmp_path: Path,
) -> None:
    """Mistral-7B-v0.1 style: the window (24) is shorter than max_model_len (128); the
    prompt alone is longer than the window and generation goes far past it."""
    path = make_checkpoint(tmp_path, "mistral", sliding_window=24)
    llm = LLM(str(path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128)
    assert [g.name for g in llm.llm_engine.runner.kv_cache_groups] == ["sliding_attention"]
    prompt = PROMPTS[3][:36]
    got = llm.generate([{"prompt_token_ids": prompt}], greedy(60), use_tqdm=False)[0]
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref.generation_config.eos_token_id = None
    want, _ = hf_generate(ref, prompt, num_tokens=60)
    assert got.outputs[0].token_ids == want
