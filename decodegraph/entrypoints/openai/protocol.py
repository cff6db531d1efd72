"""Request and response models of the OpenAI-compatible API (pydantic).

Field names, defaults and shapes follow the OpenAI API as vLLM serves it. Range checks
that can be written into the schema are, so that the OpenAPI document tells clients (and
the fuzzer) the truth; the rest is checked by `SamplingParams` and the engine.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from decodegraph.entrypoints.openai.structured_outputs import StructuredOutputFields
from decodegraph.entrypoints.openai.tool_protocol import DeltaToolCall, ToolCall, ToolFields
from decodegraph.sampling_params import ALL_LOGPROBS, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# torch.Generator.manual_seed takes [-2**63, 2**64); a wider seed would fail inside an
# engine step, where it would hurt every request, so reject it here (n > 1 adds the
# child index to the seed, hence the headroom).
_SEED_MIN = -(2**63)
_SEED_MAX = 2**63 - 1
# n sequences share one prompt but each holds KV blocks: keep a fuzzer's n=10**9 out.
MAX_N = 64
# How many logprobs a request may ask for is the engine's max_logprobs (--max-logprobs,
# default 20), checked when the request arrives; -1 asks for every token (vLLM's).


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Base of every request model: no NaN/inf floats, unknown fields ignored (as OpenAI)
    and logged in one line (as vLLM)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _log_ignored_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            ignored = data.keys() - cls.model_fields.keys()
            if ignored:
                logger.warning(
                    "The following fields were present in the request but ignored: %s",
                    sorted(ignored),
                )
        return data


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    # With include_usage: every chunk carries the usage so far (vLLM's field).
    continuous_usage_stats: bool | None = False


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by completions and chat completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=_SEED_MIN, le=_SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Token id (a JSON key, so a string) -> bias added to its logit, in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # vLLM's: top logprobs of every prompt token (the response's `prompt_logprobs`);
    # -1: every token of the vocabulary.
    prompt_logprobs: Annotated[int, Field(ge=-1)] | None = None
    # vLLM's: logprob tokens as "token_id:N" (also the --return-tokens-as-token-ids flag).
    return_tokens_as_token_ids: bool | None = None

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        output_kind: RequestOutputKind,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Build `SamplingParams`; its own checks raise ValueError naming the field."""
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else (self.stop or []),
            "stop_token_ids": self.stop_token_ids or [],
            "logprobs": logprobs,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "output_kind": output_kind,
            "logit_bias": self.logit_bias,
            "prompt_logprobs": prompt_logprobs
            if prompt_logprobs is not None
            else self.prompt_logprobs,
        }
        # Only pass what the client set, so SamplingParams' own defaults apply otherwise.
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return SamplingParams(**kwargs)


# --- /v1/completions ---------------------------------------------------------------------


class CompletionRequest(_SamplingFields, StructuredOutputFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default is 16 tokens (vLLM's too); 0 only with echo (the prompt alone).
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool = False
    # No -1 here (vLLM's completions refuse it); chat's top_logprobs and
    # prompt_logprobs take it.
    logprobs: Annotated[int, Field(ge=0)] | None = None
    suffix: str | None = None
    best_of: int | None = None

    @property
    def echo_without_generation(self) -> bool:
        """echo with max_tokens=0: the answer is the prompt (one token is generated and
        dropped, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, output_kind: RequestOutputKind) -> SamplingParams:
        """Turn the request into `SamplingParams` (ValueError names a bad field)."""
        max_tokens = 1 if self.echo_without_generation else self.max_tokens
        # echo with logprobs returns the prompt's logprobs too (OpenAI's, vLLM's answer).
        prompt_logprobs = None
        if self.echo and self.logprobs is not None:
            prompt_logprobs = (
                self.prompt_logprobs
                if self.prompt_logprobs == ALL_LOGPROBS
                else max(self.logprobs, self.prompt_logprobs or 0)
            )
        return self._sampling_params(max_tokens, self.logprobs, output_kind, prompt_logprobs)


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry in `prompt_logprobs` (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# None for the first prompt token, then token id -> its logprob, per prompt token.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# --- /v1/chat/completions ----------------------------------------------------------------


class ChatContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls and a tool turn's answer, for the chat template.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _UnsupportedChatFields(OpenAIBaseModel):
    """OpenAI chat fields this server cannot honour: declared so that a request that
    sets one gets a 400 naming it (`unsupported_fields`) instead of a silent answer."""

    audio: Any | None = None
    modalities: list[str] | None = None
    prediction: Any | None = None
    web_search_options: Any | None = None

    def unsupported_fields(self) -> list[str]:
        """The fields set that change what OpenAI would answer."""
        names = [
            n for n in ("audio", "prediction", "web_search_options") if getattr(self, n) is not None
        ]
        if self.modalities is not None and self.modalities != ["text"]:
            names.append("modalities")
        return names


class ChatCompletionRequest(
    _SamplingFields, StructuredOutputFields, ToolFields, _UnsupportedChatFields
):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # None: the rest of the context (vLLM's default for chat).
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    # -1: every token of the vocabulary (vLLM's).
    top_logprobs: Annotated[int, Field(ge=-1)] | None = None
    add_generation_prompt: bool = True

    def to_sampling_params(self, output_kind: RequestOutputKind) -> SamplingParams:
        """Turn the request into `SamplingParams` (ValueError names a bad field)."""
        # None lets the engine fill in the rest of the context.
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, output_kind)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    # Once, in the first chunk after the role's (vLLM refuses prompt_logprobs with stream);
    # absent from the others, whose fields are otherwise vLLM's.
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)


# --- /v1/models --------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "decodegraph"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
