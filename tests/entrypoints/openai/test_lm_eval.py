"""lm-evaluation-harness against the server: its `local-completions` model runs
loglikelihood, multiple-choice and generate_until tasks on stories260K and gives the
same per-item results as its own `hf` backend on the same weights.

The tasks and their four-item dataset are written by the test (no network). lm-eval
finds the server's /tokenizer_info and /tokenize and tokenizes through them (its "auto"
tokenizer backend becomes "remote", as against vLLM), without a BOS token, as the hf
backend is told to, so both score the same token ids; loglikelihoods come from `echo` +
`logprobs` (the prompt's logprobs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils.server import RunningServer, make_engine, start_server

lm_eval = pytest.importorskip("lm_eval")

ITEMS = [
    ("Once upon a time, there was a little", " girl", [" girl", " dog", " tree"], 0),
    ("Lily loved to play with her", " toys", [" toys", " mom", " ball"], 2),
    ("One day, Tom went to the", " park", [" park", " store", " sky"], 0),
    ("The sun was shining and the birds were", " singing", [" singing", " happy", " fly"], 1),
]
TASKS = {
    "stories_ll": {
        "output_type": "loglikelihood",
        "doc_to_target": "{{target}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    },
    "stories_mc": {
        "output_type": "multiple_choice",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    },
    "stories_gen": {
        "output_type": "generate_until",
        "doc_to_target": "{{target}}",
        "generation_kwargs": {"until": ["."], "max_gen_toks": 12, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    },
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"context": c, "target": t, "choices": ch, "label": label}) + "\n"
            for c, t, ch, label in ITEMS
        )
    )
    for name, spec in TASKS.items():
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": str(data)},
            "test_split": "train",
            "doc_to_text": "{{context}}",
            **spec,
        }
        # JSON is YAML: lm-eval reads the task file as YAML.
        (root / f"{name}.yaml").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def eval_server(stories_dir: Path) -> Iterator[RunningServer]:
    running = start_server(make_engine(stories_dir), enable_tokenizer_info_endpoint=True)
    yield running
    running.stop()


def _evaluate(model: str, model_args: str, task_dir: Path) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        # Only the test's tasks: indexing lm-eval's own thousands takes seconds.
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
    )


def test_local_completions_equals_hf_backend_per_item(
    eval_server: RunningServer,
    stories_dir: Path,
    task_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = _evaluate(
        "hf", f"pretrained={stories_dir},dtype=float32,device=cpu,add_bos_token=False", task_dir
    )
    api = _evaluate(
        "local-completions",
        f"base_url={eval_server.base_url}/v1/completions,model={eval_server.model_name},"
        "num_concurrent=2,max_retries=1",
        task_dir,
    )
    for task in ("stories_ll", "stories_mc"):
        ours, theirs = api["samples"][task], hf["samples"][task]
        assert len(ours) == len(theirs) == len(ITEMS)
        for a, h in zip(ours, theirs, strict=True):
            assert a["doc_id"] == h["doc_id"]
            assert len(a["filtered_resps"]) == len(h["filtered_resps"])
            for (lp_a, greedy_a), (lp_h, greedy_h) in zip(
                a["filtered_resps"], h["filtered_resps"], strict=True
            ):
                assert lp_a == pytest.approx(lp_h, abs=1e-3)
                assert greedy_a == greedy_h
            assert a["acc"] == h["acc"]
    for a, h in zip(api["samples"]["stories_gen"], hf["samples"]["stories_gen"], strict=True):
        # The hf backend decodes the continuation alone, which drops SentencePiece's
        # leading space; the server's text is the continuation in context (vLLM's too).
        assert a["filtered_resps"][0].strip() == h["filtered_resps"][0].strip()
    # Every item's loglikelihood came through echo + logprobs, and the model is greedy
    # on the first item's target: the server reports that too.
    assert api["samples"]["stories_ll"][0]["filtered_resps"][0][1] is True
