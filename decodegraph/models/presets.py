"""Named model shapes runnable with no download: `model="preset:NAME"`, random weights.

A preset is a Hugging Face config built in code plus a byte-level BPE tokenizer built
in code (256 byte tokens and `<s>`/`</s>`), so a demo or a benchmark runs on a fresh
machine. Its weights are random (load_format "dummy"): the text it generates is noise.
Real shapes (llama-3.2-1b, qwen3-0.6b) make the benchmarks meaningful; their token ids
above the tiny tokenizer's vocabulary decode to nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast, Qwen3Config

PRESET_PREFIX = "preset:"

# Byte tokens take ids 0-255 (id = byte value); the specials follow.
BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
BOS_TOKEN_ID, EOS_TOKEN_ID = 256, 257
PRESET_VOCAB_SIZE = 258

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _special_ids() -> dict[str, int]:
    # The presets' own token ids, not the real models' (their tokenizers are not here).
    return {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": None}


def _llama_tiny() -> PretrainedConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=PRESET_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        dtype="float32",
        **_special_ids(),
    )


def _llama_3_2_1b() -> PretrainedConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        dtype="bfloat16",
        **_special_ids(),
    )


def _qwen3_0_6b() -> PretrainedConfig:
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        dtype="bfloat16",
        **_special_ids(),
    )


def _qwen3_tiny() -> PretrainedConfig:
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=PRESET_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=48,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        dtype="float32",
        **_special_ids(),
    )


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-tiny": _llama_tiny,
    "qwen3-tiny": _qwen3_tiny,
    "llama-3.2-1b": _llama_3_2_1b,
    "qwen3-0.6b": _qwen3_0_6b,
}


def is_preset(model: str) -> bool:
    """Whether `model` names a preset (`preset:NAME`)."""
    return model.startswith(PRESET_PREFIX)


def get_preset_config(model: str) -> PretrainedConfig:
    """The config of preset `model` (`preset:NAME` or `NAME`); ValueError listing presets."""
    name = model.removeprefix(PRESET_PREFIX)
    if name not in PRESETS:
        raise ValueError(
            f"model: unknown preset {name!r}; presets: "
            f"{', '.join(PRESET_PREFIX + p for p in PRESETS)}"
        )
    return PRESETS[name]()


def _bytes_to_unicode() -> dict[int, str]:
    # The byte-level alphabet (GPT-2's): printable bytes map to themselves, the others to
    # code points from 256 up, so every byte is one visible character in the vocabulary.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def get_preset_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer built in code: ids 0-255 are bytes, then <s> and </s>.
    It adds <s> at the start, like Llama's, and has a minimal chat template."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS_TOKEN, EOS_TOKEN])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN
    )
    wrapped.chat_template = _CHAT_TEMPLATE
    return wrapped
