"""Engine argument defaults that follow vLLM's rules."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from decodegraph.config import SchedulerConfig
from decodegraph.engine.arg_utils import EngineArgs, UsageContext, _default_max_num_batched_tokens
from tests.utils.checkpoints import make_checkpoint


@pytest.mark.parametrize(
    "device, context, expected",
    [
        # vLLM's chunked-prefill defaults on a large GPU: 16384 offline, 8192 served.
        ("cuda", UsageContext.LLM_CLASS, 16384),
        ("cuda", UsageContext.OPENAI_API_SERVER, 8192),
        ("cuda", UsageContext.ENGINE_CONTEXT, 2048),
        ("cpu", UsageContext.LLM_CLASS, 4096),
        ("cpu", UsageContext.OPENAI_API_SERVER, 2048),
    ],
)
def test_chunked_prefill_batches_default_by_platform_and_usage(
    device: str, context: UsageContext, expected: int
) -> None:
    """At max_model_len 131072 the profiling run is no longer a 131072-token forward."""
    sc = SchedulerConfig(max_num_seqs=256)
    assert _default_max_num_batched_tokens(sc, 131072, device, context) == expected


def test_without_chunked_prefill_a_whole_prompt_fits_a_step() -> None:
    sc = SchedulerConfig(max_num_seqs=256, enable_chunked_prefill=False)
    assert _default_max_num_batched_tokens(sc, 131072, "cuda", UsageContext.LLM_CLASS) == 131072
    assert _default_max_num_batched_tokens(sc, 512, "cuda", UsageContext.LLM_CLASS) == 2048


def test_the_default_never_exceeds_max_num_seqs_full_sequences() -> None:
    sc = SchedulerConfig(max_num_seqs=2)
    assert _default_max_num_batched_tokens(sc, 256, "cuda", UsageContext.LLM_CLASS) == 512


def test_an_explicit_value_is_kept(stories_dir: Path) -> None:
    args = EngineArgs(model=str(stories_dir), max_num_batched_tokens=48, device="cpu")
    config = args.create_engine_config(UsageContext.LLM_CLASS)
    assert config.scheduler_config.max_num_batched_tokens == 48


def test_the_engine_config_applies_the_rule(stories_dir: Path) -> None:
    args = EngineArgs(model=str(stories_dir), max_model_len=256, max_num_seqs=4, device="cpu")
    assert args.create_engine_config().scheduler_config.max_num_batched_tokens == 1024


@pytest.mark.parametrize(
    "stored, asked, expected",
    [
        # bf16 checkpoints stay bf16 on CPU, AVX2 and AVX-512 alike: half the bytes of
        # fp32 in a bandwidth-bound step (docs/performance.md, "bf16 on the CPU").
        (torch.bfloat16, "auto", torch.bfloat16),
        (torch.float32, "auto", torch.float32),
        (torch.float32, "bfloat16", torch.bfloat16),  # explicit means explicit
        (torch.bfloat16, "float32", torch.float32),
    ],
)
def test_dtype_auto_on_cpu_follows_the_platform_rule_and_an_explicit_dtype_wins(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    stored: torch.dtype,
    asked: str,
    expected: torch.dtype,
) -> None:
    path = make_checkpoint(tmp_path, "qwen2", dtype=stored)
    with caplog.at_level(logging.INFO, logger="decodegraph.engine.arg_utils"):
        config = EngineArgs(model=str(path), dtype=asked, device="cpu").create_engine_config()
    assert config.model_config.dtype == expected
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype auto")]
    if asked == "auto":
        name = str(expected).removeprefix("torch.")
        assert len(logged) == 1 and logged[0].startswith(f"dtype auto: {name} for a ")
    else:
        assert logged == []
