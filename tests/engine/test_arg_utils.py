"""Engine argument defaults that follow vLLM's rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from decodegraph.config import SchedulerConfig
from decodegraph.engine.arg_utils import EngineArgs, UsageContext, _default_max_num_batched_tokens


@pytest.mark.parametrize(
    "device, context, expected",
    [
        # vLLM's chunked-prefill defaults on a large GPU: 16384 offline, 8192 served.
        ("cuda", UsageContext.LLM_CLASS, 16384),
        ("cuda", UsageContext.OPENAI_API_SERVER, 8192),
        ("cuda", UsageContext.ENGINE_CONTEXT, 2048),
        ("cpu", UsageContext.LLM_CLASS, 2048),
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
