"""The offline `LLM` API end to end on the real stories260K model (eager mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decodegraph import LLM, RequestOutput, SamplingParams
from tests.conftest import STORIES_GREEDY_TEXT
from tests.utils.requests import greedy

PROMPTS = [
    "Once upon a time",
    "Tom and Sue went to the park. They saw a big dog and",
    "The cat",
    "Lily wanted to bake a cake for her mom, so she went to the kitchen and took out",
]
GREEDY = greedy(32, ignore_eos=False)
# Plain concatenation behind the BOS token: the chat prompt is the same as the raw text.
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def llm(stories_dir: Path) -> LLM:
    return LLM(str(stories_dir), enforce_eager=True, max_model_len=256, max_num_seqs=16, seed=0)


def ids_of(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.llm_engine.get_stats()
    assert not llm.llm_engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_blocks


def test_greedy_from_bos_reproduces_published_stories_text(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": [1]}, greedy(70, ignore_eos=False))
    assert out[0].outputs[0].text.startswith(STORIES_GREEDY_TEXT)


def test_detokenize_false_gives_the_same_ids_and_no_text(llm: LLM) -> None:
    ids_only = SamplingParams(temperature=0.0, max_tokens=32, detokenize=False)
    plain = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    bare = llm.generate(PROMPTS, ids_only, use_tqdm=False)
    assert ids_of(bare) == ids_of(plain)
    assert all(o.outputs[0].text == "" for o in bare)
    assert all(o.outputs[0].text for o in plain)


def test_request_output_carries_prompt_ids_finish_reason_and_timings(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert out.finished and out.prompt == PROMPTS[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode(PROMPTS[0])
    assert out.prompt_token_ids[0] == 1  # BOS added to text prompts
    completion = out.outputs[0]
    assert completion.index == 0 and len(completion.token_ids) == 32
    assert completion.finish_reason == "length" and completion.stop_reason is None
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time


def test_batch_of_different_lengths_gives_each_request_its_solo_ids(llm: LLM) -> None:
    alone = [ids_of(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    assert len({len(llm.get_tokenizer().encode(p)) for p in PROMPTS}) == len(PROMPTS)
    assert ids_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == alone
    # Another order and duplicates: a request's ids never depend on its neighbours.
    mixed = [PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[2], PROMPTS[1]]
    assert ids_of(llm.generate(mixed, GREEDY, use_tqdm=False)) == [
        alone[i] for i in (2, 0, 3, 2, 1)
    ]
    assert_all_blocks_free(llm)


def test_text_and_token_id_prompts_are_the_same_request(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    by_text, by_ids, by_list = llm.generate(
        [PROMPTS[1], {"prompt_token_ids": ids}, ids], GREEDY, use_tqdm=False
    )
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_ids.outputs[0].token_ids == by_list.outputs[0].token_ids


def test_streamed_text_equals_decoding_prompt_and_output_for_multibyte_text(llm: LLM) -> None:
    # Hot sampling draws byte-fallback tokens; multi-byte prompts start mid-character runs.
    tok = llm.get_tokenizer()
    prompts = ["Ünïcödé 🍕 café", "日本", 'Lily said "hi', "The cat"]
    params = [SamplingParams(temperature=3.0, seed=s, max_tokens=40) for s in range(8)]
    outs = llm.generate([prompts[i % 4] for i in range(8)], params, use_tqdm=False)
    num_byte_tokens = 0
    for out in outs:
        completion = out.outputs[0]
        num_byte_tokens += sum(3 <= t < 259 for t in completion.token_ids)
        prompt_text = tok.decode(out.prompt_token_ids, skip_special_tokens=True)
        full = tok.decode(out.prompt_token_ids + completion.token_ids, skip_special_tokens=True)
        assert full.startswith(prompt_text)
        assert completion.text == full[len(prompt_text) :]
    assert num_byte_tokens > 0


def test_seeded_sampling_reproduces_across_calls_and_batch_compositions(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=32)
    first = ids_of(llm.generate(PROMPTS[0], seeded, use_tqdm=False))[0]
    assert ids_of(llm.generate(PROMPTS[0], seeded, use_tqdm=False))[0] == first
    # Beside other seeded and unseeded requests, in a different position.
    others = [
        SamplingParams(temperature=1.0, max_tokens=40),
        SamplingParams(temperature=0.7, seed=9),
    ]
    batch = llm.generate([PROMPTS[3], PROMPTS[1], PROMPTS[0]], [*others, seeded], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == first


def test_different_seeds_give_different_samples(llm: LLM) -> None:
    outs = llm.generate(
        [PROMPTS[0]] * 3,
        [SamplingParams(temperature=1.0, seed=s, max_tokens=32) for s in (1, 2, 3)],
        use_tqdm=False,
    )
    assert len({tuple(ids) for ids in ids_of(outs)}) == 3


def test_n_gives_n_indexed_reproducible_completions(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=24)
    out = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_all_blocks_free(llm)


def test_stop_string_truncates_text_and_reports_it(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64, stop=["Lily", "never there"])
    out = llm.generate({"prompt_token_ids": [1]}, params, use_tqdm=False)[0].outputs[0]
    assert out.text == "Once upon a time, there was a little girl named "
    assert out.finish_reason == "stop" and out.stop_reason == "Lily"
    assert len(out.token_ids) < 64
    assert_all_blocks_free(llm)


def test_stop_string_kept_with_include_stop_str_in_output(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=64, stop="girl", include_stop_str_in_output=True
    )
    out = llm.generate({"prompt_token_ids": [1]}, params, use_tqdm=False)[0].outputs[0]
    assert out.text == "Once upon a time, there was a little girl"
    assert out.finish_reason == "stop" and out.stop_reason == "girl"


def test_stop_token_id_ends_the_sequence_on_that_token(llm: LLM) -> None:
    greedy = ids_of(llm.generate({"prompt_token_ids": [1]}, GREEDY, use_tqdm=False))[0]
    stop_id = greedy[6]
    first = greedy.index(stop_id)
    params = SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop_id])
    out = llm.generate({"prompt_token_ids": [1]}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_min_tokens_holds_back_stop_tokens_until_reached(llm: LLM) -> None:
    greedy = ids_of(llm.generate({"prompt_token_ids": [1]}, GREEDY, use_tqdm=False))[0]
    stop_id = greedy[2]  # would stop at the third token without min_tokens
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=12, stop_token_ids=[stop_id])
    out = llm.generate({"prompt_token_ids": [1]}, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 12
    assert stop_id not in out.token_ids[:12]


def test_max_tokens_finishes_with_length(llm: LLM) -> None:
    out = llm.generate(PROMPTS[3], greedy(5, ignore_eos=False), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert out[0].outputs[0].finish_reason == "length"


def test_max_tokens_none_runs_to_max_model_len(llm: LLM) -> None:
    params = greedy(None)
    prompt = [1] + [403, 407, 261, 378] * 58  # 233 tokens: 23 steps to the limit
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 256 - len(prompt)
    assert out.outputs[0].finish_reason == "length"


def test_prompt_longer_than_max_model_len_fails_with_clear_error_and_engine_serves_on(
    llm: LLM,
) -> None:
    with pytest.raises(ValueError, match="max_model_len=256"):
        llm.generate([PROMPTS[0], {"prompt_token_ids": [1] + [300] * 300}], GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm)
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("temperature", {"temperature": -0.5}),
        ("top_p", {"top_p": 0.0}),
        ("top_k", {"top_k": -2}),
        ("max_tokens", {"max_tokens": 0}),
        ("min_tokens", {"min_tokens": 8, "max_tokens": 4}),
        ("n", {"n": 0}),
        ("logprobs", {"logprobs": -2}),  # below -1 (a count past max_logprobs: the engine's)
        ("stop", {"stop": [""]}),
        ("seed", {"seed": 1.5}),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_wrong_number_of_sampling_params_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS[:2], [GREEDY] * 3, use_tqdm=False)
    assert_all_blocks_free(llm)


def test_prompt_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [1, 512]}, GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm)


def test_chat_with_explicit_template_generates_like_the_rendered_prompt(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Once upon a time"}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=CHAT_TEMPLATE)[0]
    plain = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0]
    assert chat.prompt == "<s>Once upon a time"
    assert chat.prompt_token_ids == plain.prompt_token_ids  # "<s>" is BOS, not text
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    two = llm.chat([messages, messages], GREEDY, use_tqdm=False, chat_template=CHAT_TEMPLATE)
    assert ids_of(two) == [plain.outputs[0].token_ids] * 2


def test_chat_without_a_template_says_how_to_pass_one(llm: LLM) -> None:
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)


def test_unsupported_architecture_error_lists_the_supported_ones(
    stories_dir: Path, tmp_path: Path
) -> None:
    config = json.loads((stories_dir / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(stories_dir / "model.safetensors")
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as info:
        LLM(str(tmp_path), enforce_eager=True, skip_tokenizer_init=True)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(info.value)


def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_refused_before_any_worker(
    stories_dir: Path,
) -> None:
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(3\) must divide num_attention_heads \(8\)"
    ):
        LLM(str(stories_dir), tensor_parallel_size=3, enforce_eager=True)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])
def test_kv_cache_dtype_auto_or_the_model_dtype_is_accepted(
    stories_dir: Path, kv_cache_dtype: str
) -> None:
    llm = LLM(str(stories_dir), kv_cache_dtype=kv_cache_dtype, enforce_eager=True)
    k_cache, _ = llm.llm_engine.runner.attn_backend.kv_caches[0]
    assert k_cache.dtype == torch.float32  # stories260K's dtype
    out = llm.generate({"prompt_token_ids": [1]}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].text.startswith("Once upon a time")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2", "bfloat16", "int4"])
def test_other_kv_cache_dtypes_are_refused_naming_the_field(
    stories_dir: Path, kv_cache_dtype: str
) -> None:
    with pytest.raises(ValueError, match="^kv_cache_dtype:") as info:
        LLM(str(stories_dir), kv_cache_dtype=kv_cache_dtype, enforce_eager=True)
    assert "auto" in str(info.value)


def test_unknown_llm_keyword_is_a_type_error(stories_dir: Path) -> None:
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(str(stories_dir), max_num_sequences=4)


def test_engine_core_process_gives_the_same_greedy_ids(
    llm: LLM, stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLM(engine_core_process=True), or DECODEGRAPH_ENABLE_MULTIPROCESSING=1 (vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING), runs the engine core in a process of its own; the
    answers are the in-process engine's, stop strings and n included."""
    kwargs = {"enforce_eager": True, "max_model_len": 256, "max_num_seqs": 16, "seed": 0}
    params = [GREEDY] * len(PROMPTS) + [
        SamplingParams(max_tokens=24, temperature=0.0, stop=[" the"]),
        SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=5),
    ]
    prompts = PROMPTS + PROMPTS[:2]
    want = llm.generate(prompts, params, use_tqdm=False)
    for env, keyword in (("1", {}), (None, {"engine_core_process": True})):
        if env is None:
            monkeypatch.delenv("DECODEGRAPH_ENABLE_MULTIPROCESSING", raising=False)
        else:
            monkeypatch.setenv("DECODEGRAPH_ENABLE_MULTIPROCESSING", env)
        proc = LLM(str(stories_dir), **keyword, **kwargs)
        try:
            assert proc.llm_engine.engine_core_process
            got = proc.generate(prompts, params, use_tqdm=False)
            assert ids_of(got) == ids_of(want)
            assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
            assert [c.token_ids for c in got[-1].outputs] == [c.token_ids for c in want[-1].outputs]
            assert not proc.llm_engine.has_unfinished_requests()
        finally:
            proc.llm_engine.shutdown()
    monkeypatch.setenv("DECODEGRAPH_ENABLE_MULTIPROCESSING", "yes")
    with pytest.raises(ValueError, match="DECODEGRAPH_ENABLE_MULTIPROCESSING"):
        LLM(str(stories_dir), **kwargs)
