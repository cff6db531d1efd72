"""The synchronous engine: requests in, one scheduled and executed step at a time.

step():  engine_core.step() [scheduler.schedule() -> dispatcher (the step's plan) ->
         executor.execute_model() (every rank's model runner) ->
         scheduler.update_from_output()] -> output_processor (detokenize, stop strings)

The engine lives in the driver; the model runners live in the executor's workers (in
this process at tensor_parallel_size 1). The driver's dispatcher decides each step's
runtime mode and padded key once, and every rank runs that plan (docs/design.md §8).

With `engine_core_process`, the EngineCore (and with it the executor and its workers)
runs in a process of its own that steps by itself (engine/core_proc.py); this engine
keeps the tokenizer, validation and the output processor, sends it requests and reads
its outputs (engine/core_client.py), so that none of the core's Python shares this
process's GIL.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from decodegraph.config import EngineConfig
from decodegraph.core.sched_output import EngineCoreOutput
from decodegraph.engine.arg_utils import EngineArgs, UsageContext
from decodegraph.engine.core import EngineCore, EngineCoreRequest, EngineStats
from decodegraph.engine.output_processor import OutputProcessor
from decodegraph.outputs import RequestOutput
from decodegraph.platforms import get_platform
from decodegraph.request import RequestStatus
from decodegraph.sampling_params import ALL_LOGPROBS, SamplingParams
from decodegraph.structured_output.manager import StructuredOutputManager
from decodegraph.tokenizer import get_tokenizer
from decodegraph.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from decodegraph.engine.core_client import EngineCoreClient

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


class LLMEngine:
    """Text in, text out: the tokenizer, request intake and the output processor, over
    an `EngineCore` (scheduler, dispatcher, executor)."""

    def __init__(self, config: EngineConfig, *, engine_core_process: bool = False) -> None:
        mc = config.model_config
        self.config = config
        self.model_config = mc
        self.platform = get_platform(config.device_config.device)
        self.platform.check_and_update_config(config)
        torch.manual_seed(mc.seed)
        self.tokenizer = get_tokenizer(mc, mc.model_path)
        self.eos_token_id, self.extra_eos_token_ids = eos_token_ids(mc, self.tokenizer)
        # Here it compiles grammars to refuse bad ones before anything is queued (and,
        # with the core in this process, is the core's too).
        self.structured_output = make_structured_output(config, self.tokenizer)
        self.vocab_size: int = mc.hf_config.vocab_size
        self.engine_core: EngineCore | EngineCoreClient
        if engine_core_process:
            from decodegraph.engine.core_client import EngineCoreClient

            self.engine_core = EngineCoreClient(config)
            self.scheduler = None  # in the core's process
        else:
            self.engine_core = EngineCore(config, self.platform, self.structured_output)
            # The parts callers (the CLI, benchmarks, tests) read directly.
            self.platform = self.engine_core.platform
            self.scheduler = self.engine_core.scheduler
        self.engine_core_process = engine_core_process
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        *,
        engine_core_process: bool = False,
    ) -> LLMEngine:
        return cls(
            engine_args.create_engine_config(usage_context),
            engine_core_process=engine_core_process,
        )

    # ---------------------------------------------------------------- start-up

    @property
    def runner(self) -> ModelRunner:
        """The model runner, where it shares this process (tensor_parallel_size 1)."""
        if isinstance(self.engine_core, EngineCore):
            return self.engine_core.runner
        raise AttributeError("the model runner lives in the engine core's process")

    # ---------------------------------------------------------------- requests

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer (skip_tokenizer_init is set)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt: expected str, token ids or a dict, got {type(prompt).__name__}")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError and changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params: expected SamplingParams, got {type(params).__name__}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop: stop strings need a tokenizer to match text (skip_tokenizer_init is "
                "set); use stop_token_ids"
            )
        if params.structured_outputs is not None:
            # Compiled (and cached) now, so an invalid spec fails before anything is queued.
            self.structured_output.compile(params.structured_outputs)
        text, ids = self._tokenize(prompt)
        max_len, vocab = self.model_config.max_model_len, self.vocab_size
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids: every token id must be an int in [0, {vocab})")
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= vocab)
            if bad:
                raise ValueError(
                    f"logit_bias: token id(s) {bad} are out of vocabulary [0, {vocab})"
                )
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within "
                f"max_model_len={max_len}"
            )
        self._check_logprobs(params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_ids = (
            [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        )
        children = []
        for i, child_id in enumerate(child_ids):
            child_params = params if params.n == 1 else params.for_child(i)
            extra_eos = []
            if not child_params.ignore_eos:
                extra_eos = [
                    t for t in self.extra_eos_token_ids if t not in child_params.stop_token_ids
                ]
            counts = [_logprob_count(getattr(child_params, n), vocab) for n in _LOGPROB_FIELDS]
            own = [getattr(child_params, n) for n in _LOGPROB_FIELDS]
            if child_params.max_tokens is None or extra_eos or counts != own:
                child_params = child_params.clone()  # never change the caller's object
                if child_params.max_tokens is None:
                    child_params.max_tokens = max_len - len(ids)
                child_params.stop_token_ids += extra_eos
                # The core sees counts it can take the top of: -1 is the vocabulary.
                child_params.logprobs, child_params.prompt_logprobs = counts
            children.append(
                EngineCoreRequest(child_id, ids, child_params, self.eos_token_id, arrival)
            )
        self.output_processor.add_request(request_id, text, ids, params, child_ids, arrival)
        for child in children:
            self.engine_core.add_request(child)

    def _check_logprobs(self, params: SamplingParams) -> None:
        """At most max_logprobs logprobs per token (-1, every token, counts as the
        vocabulary), as vLLM's processor checks them."""
        limit = self.model_config.max_logprobs
        cap = self.vocab_size if limit == ALL_LOGPROBS else limit
        for name in _LOGPROB_FIELDS:
            value = getattr(params, name)
            if value is None:
                continue
            wanted = self.vocab_size if value == ALL_LOGPROBS else value
            if wanted > cap:
                raise ValueError(
                    f"{name}: {value} asks for {wanted} logprobs per token, more than "
                    f"max_logprobs={limit} allows (--max-logprobs; -1 lifts the cap)"
                )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort parent requests (their children too); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            children = self.output_processor.child_ids(rid)
            self.engine_core.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        if self.scheduler is None:  # the core's process has the scheduler
            return self.output_processor.has_unfinished_requests()
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        if self.scheduler is None:
            return self.output_processor.get_num_unfinished_requests()
        return self.scheduler.get_num_unfinished_requests()

    # ---------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch (with the core in its own process: wait for the next
        one it ran); return the outputs of requests that progressed."""
        return self.process_outputs(self.engine_core.get_output())

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Text, stop strings and `RequestOutput`s for one step's core outputs; the
        sequences a stop string ended are finished in the core."""
        if not core_outputs:
            return []
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.reqs_to_abort:
            self.engine_core.finish_requests(
                processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED
            )
        return processed.request_outputs

    def check_health(self) -> None:
        """Raise EngineDeadError once a step failed or a worker is gone."""
        self.engine_core.check_health()

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        self.engine_core.shutdown()

    # ---------------------------------------------------------------- introspection

    def get_stats(self) -> EngineStats:
        """The core's stats (with the core in its own process, the latest it sent)."""
        return self.engine_core.get_stats()

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """Render `messages` with the model's (or the given) chat template; `tools`
        (OpenAI's function dicts) go to the template as its `tools`."""
        if self.tokenizer is None:
            raise ValueError("messages: chat needs a tokenizer (skip_tokenizer_init is set)")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                "chat_template: this model's tokenizer has no chat template; pass one "
                "(chat_template=... / --chat-template)"
            )
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools,
        )


_LOGPROB_FIELDS = ("logprobs", "prompt_logprobs")


def _logprob_count(value: int | None, vocab_size: int) -> int | None:
    """How many top logprobs the core computes for a request's `value`: -1 and anything
    past the vocabulary are the whole vocabulary."""
    if value is None:
        return None
    return vocab_size if value == ALL_LOGPROBS else min(value, vocab_size)


def eos_token_ids(model_config: Any, tokenizer: Any | None) -> tuple[int | None, list[int]]:
    """The model's EOS id and any further ones it lists.

    Instruct models often list several (Llama 3.x: end_of_text, eom_id, eot_id) in
    config.json or generation_config.json; as in vLLM, the first is the EOS and the
    others act as stop token ids of every request that does not ignore EOS.
    """
    ids: list[int] = []
    for eos in (
        getattr(model_config.hf_config, "eos_token_id", None),
        _generation_config(model_config.model_path).get("eos_token_id"),
    ):
        for t in eos if isinstance(eos, (list, tuple)) else [eos]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return (ids[0] if ids else None), ids[1:]


def make_structured_output(config: EngineConfig, tokenizer: Any | None) -> StructuredOutputManager:
    """The grammar compiler for `config`'s model (the front's and the core's alike)."""
    mc = config.model_config
    eos, extra = eos_token_ids(mc, tokenizer)
    return StructuredOutputManager(
        tokenizer,
        mc.hf_config.vocab_size,
        [t for t in [eos, *extra] if t is not None],
        config.structured_outputs_config,
    )


def _generation_config(path: str | Path | None) -> dict:
    file = Path(path) / "generation_config.json" if path is not None else None
    if file is None or not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        logger.warning("Ignoring unreadable %s: %s", file, e)
        return {}
