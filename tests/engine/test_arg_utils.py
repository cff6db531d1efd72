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


def test_parallel_flags_reach_the_parallel_config(stories_dir: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    flags = [
        "--model", str(stories_dir), "--device", "cpu", "-tp", "2",
        "--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.1", "--master-port", "29555",
        "--worker-cls", "tests.executor.dummy_worker.DummyWorker",
    ]  # fmt: skip
    config = EngineArgs.from_cli_args(parser.parse_args(flags)).create_engine_config()
    pc = config.parallel_config
    assert (pc.tensor_parallel_size, pc.distributed_executor_backend) == (2, "mp")
    assert (pc.nnodes, pc.node_rank, pc.master_addr, pc.master_port) == (2, 1, "10.0.0.1", 29555)
    assert pc.worker_cls == "tests.executor.dummy_worker.DummyWorker"


def test_parallel_flags_default_to_one_local_rank_in_process(stories_dir: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", str(stories_dir), "--device", "cpu"])
    pc = EngineArgs.from_cli_args(args).create_engine_config().parallel_config
    assert (pc.tensor_parallel_size, pc.distributed_executor_backend, pc.nnodes) == (1, "uni", 1)
    assert (pc.master_addr, pc.master_port) == ("127.0.0.1", None)


def test_an_unknown_executor_backend_is_refused_by_the_parser() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--distributed-executor-backend", "threads"])


def test_a_bad_parallel_value_names_its_field(stories_dir: Path) -> None:
    args = EngineArgs(model=str(stories_dir), device="cpu", tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match="^tensor_parallel_size:"):
        args.create_engine_config()


def test_max_logprobs_flag_reaches_the_model_config(stories_dir: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", str(stories_dir), "--max-logprobs", "-1"])
    assert EngineArgs.from_cli_args(args).create_engine_config().model_config.max_logprobs == -1
    default = parser.parse_args(["--model", str(stories_dir)])
    assert EngineArgs.from_cli_args(default).create_engine_config().model_config.max_logprobs == 20
    with pytest.raises(ValueError, match="^max_logprobs:"):
        EngineArgs(model=str(stories_dir), max_logprobs=-2).create_engine_config()


def test_num_scheduler_steps_flag_reaches_the_scheduler_config(stories_dir: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", str(stories_dir), "--num-scheduler-steps", "8"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.scheduler_config.num_scheduler_steps == 8
    default = parser.parse_args(["--model", str(stories_dir)])
    sc = EngineArgs.from_cli_args(default).create_engine_config().scheduler_config
    assert sc.num_scheduler_steps == 1
    with pytest.raises(ValueError, match="^num_scheduler_steps:"):
        EngineArgs(model=str(stories_dir), num_scheduler_steps=0).create_engine_config()
