"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from decodegraph.gc_utils import collector_paused

with collector_paused():  # torch, transformers' configurations, Dynamo (gc_utils)
    from decodegraph.engine.arg_utils import EngineArgs, UsageContext
    from decodegraph.engine.llm_engine import LLMEngine, PromptType
    from decodegraph.outputs import RequestOutput
    from decodegraph.sampling_params import RequestOutputKind, SamplingParams

_ENGINE_ARG_NAMES = {f.name for f in dataclasses.fields(EngineArgs)}
# "1": LLM runs its engine core in a process of its own unless told otherwise (vLLM's
# VLLM_ENABLE_V1_MULTIPROCESSING; here off by default, as serve's --engine-core-process).
ENABLE_MULTIPROCESSING_ENV = "DECODEGRAPH_ENABLE_MULTIPROCESSING"


def _engine_core_process_default() -> bool:
    value = os.environ.get(ENABLE_MULTIPROCESSING_ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENABLE_MULTIPROCESSING_ENV}: must be 0 or 1, got {value!r}")
    return value == "1"


def _final_only(params: SamplingParams) -> SamplingParams:
    """Offline generation returns finished outputs only (as vLLM's LLM does), so the
    engine builds no per-step outputs."""
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    final = params.clone()
    final.output_kind = RequestOutputKind.FINAL_ONLY
    return final


class LLM:
    """An engine for offline batch generation, with vLLM's keywords.

    `engine_core_process=True` (default: DECODEGRAPH_ENABLE_MULTIPROCESSING=1) runs the
    engine core (scheduler, executor, workers) in a process of its own, as `serve
    --engine-core-process` does (docs/design.md §8)."""

    def __init__(
        self, model: str, *, engine_core_process: bool | None = None, **kwargs: Any
    ) -> None:
        unknown = sorted(set(kwargs) - _ENGINE_ARG_NAMES)
        if unknown:
            raise TypeError(f"LLM() got unknown keyword(s) {unknown}")
        if engine_core_process is None:
            engine_core_process = _engine_core_process_default()
        if not isinstance(engine_core_process, bool):
            raise ValueError(f"engine_core_process: must be a bool, got {engine_core_process!r}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(
            self.engine_args, UsageContext.LLM_CLASS, engine_core_process=engine_core_process
        )
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt that fails validation (too long, empty, bad ids) raises ValueError
        before anything is queued.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [_final_only(sampling_params)] * len(prompts)
        else:
            params_list = [_final_only(p) for p in sampling_params]
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: {len(params_list)} given for {len(prompts)} prompts"
                )
        return self._run(prompts, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate;
        `tools` (OpenAI's function dicts) go to the template, as vLLM's `LLM.chat`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = self.llm_engine.apply_chat_template(
                conv, add_generation_prompt, chat_template, tools=tools
            )
            ids = self.llm_engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(
        self, prompts: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                rid = str(next(self._counter))
                engine.add_request(rid, prompt, params)
                ids.append(rid)
        except ValueError:
            engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[rid] for rid in ids]
