"""The other sides of bench_decode.py: CTranslate2, llama2.c and transformers, each behind
one small class with the same two workloads, and the memory-bandwidth floor every row is
held against.

A side is built once and then called round by round, interleaved with the engine:
- `batch1(tokens)`: tokens/s of one request generating `tokens` tokens from BOS;
- `batched(prompts, tokens)`: tokens/s of every prompt generating `tokens` tokens at
  once, or None where the side has no batching (llama2.c).
EOS never ends a request: every side generates exactly the tokens it is asked for, greedy.

Peers that are not installed or cannot be built raise `PeerUnavailable` with the reason,
which the benchmark prints and records.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
# The project's shared folder sits beside the main checkout, two levels up from a worktree.
LLAMA2C_DIR = next(
    (
        d / "shared" / "peers" / "llama2c"
        for d in (_ROOT, _ROOT.parent, _ROOT.parent.parent)
        if (d / "shared" / "peers" / "llama2c").is_dir()
    ),
    _ROOT.parent / "shared" / "peers" / "llama2c",
)


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here; the message says why."""


# ---------------------------------------------------------------------------------------
# The floor: bytes each decode step must read over a bandwidth measured on this machine.


@dataclass(frozen=True)
class Bandwidth:
    """Streaming bandwidth at the benchmark's thread count, GB/s (1e9 bytes/s)."""

    read_gbs: float  # torch.sum over a tensor far larger than the caches: bytes read
    copy_gbs: float  # Tensor.copy_ between two such tensors: bytes read plus written
    # torch.mv (BLAS's matrix-vector product) of such a tensor as a matrix of rows of
    # _GEMV_ROW values: the matrix's bytes read. A decode step's own access pattern, and
    # on a CPU whose hardware prefetcher stops at each 4 KiB page (an Intel Xeon here),
    # faster than the plain sum, which leaves the stream to that prefetcher.
    gemv_gbs: float

    @property
    def floor_gbs(self) -> float:
        """The fastest of the three: the tightest measured ceiling for a decode step,
        which reads (a slower probe would put rows above their floor)."""
        return max(self.read_gbs, self.copy_gbs, self.gemv_gbs)


# Row length of the GEMV probe's matrix: the Qwen2.5-0.5B shape's hidden size.
_GEMV_ROW = 896


def measure_bandwidth(mib: int = 512, repeats: int = 7) -> Bandwidth:
    """Median of `repeats` streaming reads, copies and matrix-vector products of a
    `mib`-MiB fp32 tensor, at torch's current intra-op thread count."""
    x = torch.ones(mib * 2**20 // 4 // _GEMV_ROW * _GEMV_ROW)
    y = torch.empty_like(x)
    y.copy_(x)  # fault every page in before timing
    matrix, vector = x.view(-1, _GEMV_ROW), torch.ones(_GEMV_ROW)
    reads, copies, gemvs = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        reads.append(x.nbytes / (time.perf_counter() - start))
        start = time.perf_counter()
        y.copy_(x)
        copies.append(2 * x.nbytes / (time.perf_counter() - start))
        start = time.perf_counter()
        torch.mv(matrix, vector)
        gemvs.append(x.nbytes / (time.perf_counter() - start))
    return Bandwidth(
        statistics.median(reads) / 1e9,
        statistics.median(copies) / 1e9,
        statistics.median(gemvs) / 1e9,
    )


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step reads from memory, from the checkpoint's shapes."""

    weight_bytes: int  # every weight a step reads once: the LM head, not the embedding
    kv_bytes_per_position: int  # K and V of one cached position, all layers

    def floor_tokens_per_s(self, bandwidth_gbs: float, batch: int, mean_context: float) -> float:
        """Tokens/s at which `batch` sequences of `mean_context` cached positions would
        take exactly the bandwidth: weights once per step, each sequence's KV once."""
        step_bytes = self.weight_bytes + batch * self.kv_bytes_per_position * mean_context
        return batch * bandwidth_gbs * 1e9 / step_bytes


def decode_bytes(model_dir: Path, dtype: torch.dtype) -> DecodeBytes:
    """Weights and KV bytes per decode step of a Llama-style checkpoint run in `dtype`.

    The embedding table is read one row per token, so it only counts where it is also the
    LM head (tied embeddings)."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    numels: dict[str, int] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                numels[name] = _numel(f, name)
    total = sum(numels.values())
    embed = next((n for k, n in numels.items() if k.endswith("embed_tokens.weight")), 0)
    if any(k.endswith("lm_head.weight") for k in numels):
        total -= embed
    size = torch.empty((), dtype=dtype).element_size()
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    kv = 2 * config["num_hidden_layers"] * kv_heads * head_dim * size
    return DecodeBytes(weight_bytes=total * size, kv_bytes_per_position=kv)


def _numel(f, name: str) -> int:  # noqa: ANN001
    n = 1
    for d in f.get_slice(name).get_shape():
        n *= d
    return n


# ---------------------------------------------------------------------------------------
# The mid-size checkpoint.

# Qwen2.5-0.5B's shapes (its config.json), with random weights.
QWEN2_5_0_5B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    vocab_size=151936,
)


def make_mid_checkpoint(
    out: Path, dtype: torch.dtype, seed: int = 0, **overrides: int | float | bool
) -> Path:
    """A Qwen2.5-0.5B-shaped checkpoint with random weights in `dtype` under `out`, with
    decodegraph's byte-level preset tokenizer (CTranslate2's converter needs one; it
    pads the vocabulary to the model's). Reused when `out` already holds one.
    `overrides` change config fields (the tests shrink it)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from decodegraph.models.presets import get_preset_tokenizer

    if (out / "config.json").exists():
        return out
    name = str(dtype).removeprefix("torch.")
    config = Qwen2Config(
        architectures=["Qwen2ForCausalLM"], dtype=name, **{**QWEN2_5_0_5B, **overrides}
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    get_preset_tokenizer().save_pretrained(tmp)
    tmp.rename(out)
    return out


# ---------------------------------------------------------------------------------------
# The peers.

_HF_GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


class TransformersSide:
    """transformers `generate()`, eager attention off its default (sdpa), greedy."""

    name = "transformers"

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        with torch.inference_mode():  # first-call work out of the first round
            self.model.generate(torch.tensor([[1]]), max_new_tokens=4, **_HF_GREEDY)

    @torch.inference_mode()
    def batch1(self, tokens: int) -> float:
        start = time.perf_counter()
        self.model.generate(
            torch.tensor([[1]]), max_new_tokens=tokens, min_new_tokens=tokens, **_HF_GREEDY
        )
        return tokens / (time.perf_counter() - start)

    @torch.inference_mode()
    def batched(self, prompts: list[list[int]], tokens: int) -> float:
        batch = torch.tensor(prompts)
        start = time.perf_counter()
        self.model.generate(batch, max_new_tokens=tokens, min_new_tokens=tokens, **_HF_GREEDY)
        return len(prompts) * tokens / (time.perf_counter() - start)


class CTranslate2Side:
    """CTranslate2's `Generator` on a copy converted with its transformers converter into
    a temporary directory, `intra_threads` at the benchmark's count, greedy."""

    name = "ctranslate2"

    def __init__(self, model_dir: Path, dtype: torch.dtype, threads: int, work: Path) -> None:
        try:
            import ctranslate2
            from ctranslate2.converters import TransformersConverter
        except ImportError as e:
            raise PeerUnavailable(
                f"ctranslate2 is not installed (pip install -r benchmarks/requirements.txt): {e}"
            ) from None
        compute = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
        if compute not in ctranslate2.get_supported_compute_types("cpu"):
            raise PeerUnavailable(
                f"ctranslate2 {ctranslate2.__version__} has no {compute} compute type on this "
                f"CPU (it has {sorted(ctranslate2.get_supported_compute_types('cpu'))})"
            )
        out = work / f"ct2-{model_dir.name}-{compute}"
        if not out.exists():
            TransformersConverter(str(model_dir)).convert(str(out), quantization=compute)
        self.version = ctranslate2.__version__
        self.generator = ctranslate2.Generator(
            str(out), device="cpu", compute_type=compute, intra_threads=threads, inter_threads=1
        )
        vocab = json.loads((out / "vocabulary.json").read_text())
        self.vocab = vocab
        self.bos = vocab[1]
        self.generator.generate_batch([[self.bos]], max_length=4, include_prompt_in_result=False)

    def batch1(self, tokens: int) -> float:
        """Tokens over wall time (`generate_tokens` yields from a worker thread, in bursts,
        so its steps cannot be timed one by one)."""
        start = time.perf_counter()
        self.generator.generate_batch(
            [[self.bos]],
            max_length=tokens,
            min_length=tokens,
            end_token=[],
            include_prompt_in_result=False,
        )
        return tokens / (time.perf_counter() - start)

    def batched(self, prompts: list[list[int]], tokens: int) -> float:
        start_tokens = [[self.vocab[i] for i in p] for p in prompts]
        start = time.perf_counter()
        results = self.generator.generate_batch(
            start_tokens,
            max_length=tokens,
            min_length=tokens,
            end_token=[],
            include_prompt_in_result=False,
        )
        elapsed = time.perf_counter() - start
        return sum(len(r.sequences_ids[0]) for r in results) / elapsed


class Llama2cSide:
    """llama2.c's `run.c`, built here with gcc -O3 -march=`march` (native by default; no
    OpenMP: one thread), on stories260K in its own format; its printed "achieved tok/s"
    (from the second token on). Batch 1 only."""

    name = "llama2.c"

    def __init__(self, work: Path, source: Path = LLAMA2C_DIR, march: str = "native") -> None:
        gcc = shutil.which("gcc")
        if gcc is None:
            raise PeerUnavailable("gcc is not on PATH")
        if not (source / "run.c").exists():
            raise PeerUnavailable(f"no llama2.c sources at {source}")
        self.source = source
        self.binary = work / ("llama2c_run" if march == "native" else f"llama2c_run_{march}")
        cmd = [gcc, "-O3", f"-march={march}", "-o", str(self.binary), str(source / "run.c"), "-lm"]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode != 0:
            raise PeerUnavailable(f"building run.c failed: {built.stderr.strip()[-300:]}")

    def batch1(self, tokens: int) -> float:
        cmd = [
            str(self.binary),
            str(self.source / "stories260K.bin"),
            *("-z", str(self.source / "tok512.bin"), "-t", "0", "-n", str(tokens + 1), "-i", ""),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        m = re.search(r"achieved tok/s: ([0-9.]+|inf)", out.stdout + out.stderr)
        if m is None:
            raise RuntimeError(f"llama2.c printed no tok/s: {out.stderr[-300:]}")
        if m.group(1) == "inf":  # the run took under one tick of its millisecond timer
            raise RuntimeError(f"{tokens} tokens are too few for llama2.c's timer")
        return float(m.group(1))

    def batched(self, prompts: list[list[int]], tokens: int) -> float | None:
        return None


def work_dir() -> Path:
    """One temporary directory per run for built and converted peers."""
    return Path(tempfile.mkdtemp(prefix="bench_decode_"))
