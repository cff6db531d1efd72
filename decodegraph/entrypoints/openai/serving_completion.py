"""POST /v1/completions: plain and streamed, several prompts, n, echo, logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from decodegraph.engine.async_llm import EngineDeadError
from decodegraph.entrypoints.openai.logprobs import LogprobFormatter, prompt_logprobs_field
from decodegraph.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    PromptLogprobs,
    UsageInfo,
    random_uuid,
)
from decodegraph.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    check_stream_options,
    continuous_usage,
    error_body,
    merge_streams,
    sse,
    until_disconnect,
)
from decodegraph.entrypoints.openai.stream_chunks import CompletionChunkWriter
from decodegraph.entrypoints.openai.structured_outputs import (
    attach_structured_outputs,
    structured_outputs_of,
)
from decodegraph.outputs import CompletionOutput, Logprob, RequestOutput
from decodegraph.sampling_params import RequestOutputKind


@dataclass
class _Choice:
    """One choice accumulated from DELTA outputs."""

    text: str = ""
    num_tokens: int = 0
    logprobs: CompletionLogProbs | None = None
    # Characters already emitted, the base of the next token's text_offset.
    offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None


class OpenAIServingCompletion(OpenAIServing):
    """Handler of /v1/completions."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Validate, submit one engine request per prompt, answer plain or streamed."""
        self.check_model(request.model)
        prompts = self._prompts(request.prompt)
        check_unsupported(request)
        check_stream_options(request.stream, request.stream_options)
        params = self.build_params(request.to_sampling_params, RequestOutputKind.DELTA)
        spec = self.build_params(structured_outputs_of, request)
        await attach_structured_outputs(self.async_llm.engine, params, spec)
        inputs = [self.tokenize(p) for p in prompts]
        if not request.echo_without_generation:
            for prompt in inputs:
                self.check_max_tokens(request.max_tokens, prompt)
        request_id = f"cmpl-{random_uuid()}"
        streams = await self.submit(request_id, inputs, params)
        outputs = merge_streams(streams)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, prompts, outputs), media_type="text/event-stream"
            )
        return await until_disconnect(
            raw_request, self._full(request, request_id, prompts, outputs)
        )

    @staticmethod
    def _prompts(prompt: str | list) -> list[str | list[int]]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise OpenAIError("prompt: must not be empty", 400, "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if any(isinstance(p, list) and not p for p in prompt):
            raise OpenAIError("prompt: a token id list must not be empty", 400, "prompt")
        return list(prompt)

    def _echo_text(
        self, prompt: str | list[int], out: RequestOutput, request: CompletionRequest
    ) -> str:
        if isinstance(prompt, str):
            return prompt
        if out.prompt is not None:
            return out.prompt
        if self.tokenizer is None:
            return ""
        # Rendered as generated text is (special tokens skipped by default), so that the
        # prompt's logprob tokens concatenate to it.
        return self.tokenizer.decode(
            out.prompt_token_ids, skip_special_tokens=request.skip_special_tokens
        )

    def _update(
        self,
        choice: _Choice,
        c: CompletionOutput,
        prompt: str | list[int],
        out: RequestOutput,
        request: CompletionRequest,
        fmt: LogprobFormatter,
        prompt_lps: list[dict[int, Logprob] | None] | None,
    ) -> str:
        """Fold one delta into a choice; return the text this delta adds. `prompt_lps`
        are the prompt's logprobs once known (a DELTA request sends them once, possibly
        before this choice's first output)."""
        num_top = request.logprobs or 0
        delta = c.text
        if not choice.started:
            choice.started = True
            if request.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs_field(prompt_lps)
            if request.echo:
                echo_text = self._echo_text(prompt, out, request)
                if request.logprobs is not None and prompt_lps is not None:
                    choice.logprobs = CompletionLogProbs()
                    fmt.extend_completion(
                        choice.logprobs,
                        out.prompt_token_ids,
                        prompt_lps,
                        num_top,
                        0,
                    )
                delta = echo_text + delta
                choice.offset = len(echo_text)
        choice.num_tokens += len(c.token_ids)
        if request.echo_without_generation:
            # The prompt is the answer; the one token generated to get there is dropped.
            delta = delta[: len(delta) - len(c.text)]
        else:
            choice.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if choice.logprobs is None:
                    choice.logprobs = CompletionLogProbs()
                choice.offset = fmt.extend_completion(
                    choice.logprobs, c.token_ids, c.logprobs, num_top, choice.offset
                )
        choice.text += delta
        if c.finish_reason is not None:
            choice.finish_reason = c.finish_reason
            choice.stop_reason = c.stop_reason
        return delta

    async def _full(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[str | list[int]],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> CompletionResponse:
        n = request.n
        fmt = self.logprob_formatter(request.return_tokens_as_token_ids)
        choices = [_Choice() for _ in range(len(prompts) * n)]
        prompt_tokens = [0] * len(prompts)
        prompt_lps: list[list[dict[int, Logprob] | None] | None] = [None] * len(prompts)
        try:
            async for i, out in outputs:
                prompt_tokens[i] = len(out.prompt_token_ids)
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = out.prompt_logprobs
                for c in out.outputs:
                    self._update(
                        choices[i * n + c.index], c, prompts[i], out, request, fmt, prompt_lps[i]
                    )
        except EngineDeadError as e:
            raise OpenAIError(str(e), 503) from None
        completion_tokens = sum(ch.num_tokens for ch in choices)
        return CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=[
                CompletionResponseChoice(
                    index=k,
                    text=ch.text,
                    logprobs=ch.logprobs,
                    finish_reason=ch.finish_reason,
                    stop_reason=ch.stop_reason,
                    prompt_logprobs=ch.prompt_logprobs,
                )
                for k, ch in enumerate(choices)
            ],
            usage=UsageInfo(
                prompt_tokens=sum(prompt_tokens),
                completion_tokens=completion_tokens,
                total_tokens=sum(prompt_tokens) + completion_tokens,
            ),
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[str | list[int]],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[str]:
        n = request.n
        created = int(time.time())
        fmt = self.logprob_formatter(request.return_tokens_as_token_ids)
        every_chunk_usage = continuous_usage(request.stream_options)
        writer = CompletionChunkWriter(request_id, created, self.model_name)
        choices = [_Choice() for _ in range(len(prompts) * n)]
        prompt_tokens = [0] * len(prompts)
        prompt_lps: list[list[dict[int, Logprob] | None] | None] = [None] * len(prompts)
        try:
            async for i, out in outputs:
                prompt_tokens[i] = len(out.prompt_token_ids)
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = out.prompt_logprobs
                for c in out.outputs:
                    k = i * n + c.index
                    choice = choices[k]
                    num_lp = len(choice.logprobs.tokens) if choice.logprobs else 0
                    first = not choice.started
                    delta = self._update(choice, c, prompts[i], out, request, fmt, prompt_lps[i])
                    if not delta and not c.token_ids and c.finish_reason is None:
                        continue
                    prompt_logprobs = choice.prompt_logprobs if first else None
                    if choice.logprobs is None and prompt_logprobs is None:
                        yield writer.text(
                            k,
                            delta,
                            c.finish_reason,
                            c.stop_reason,
                            _usage_counts(prompt_tokens, choices) if every_chunk_usage else None,
                        )
                        continue
                    logprobs = None
                    if choice.logprobs is not None:
                        lp = choice.logprobs
                        logprobs = CompletionLogProbs(
                            text_offset=lp.text_offset[num_lp:],
                            token_logprobs=lp.token_logprobs[num_lp:],
                            tokens=lp.tokens[num_lp:],
                            top_logprobs=lp.top_logprobs[num_lp:],
                        )
                    yield sse(
                        CompletionStreamResponse(
                            id=request_id,
                            created=created,
                            model=self.model_name,
                            choices=[
                                CompletionResponseChoice(
                                    index=k,
                                    text=delta,
                                    logprobs=logprobs,
                                    finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason,
                                    prompt_logprobs=prompt_logprobs,
                                )
                            ],
                            usage=_usage(prompt_tokens, choices) if every_chunk_usage else None,
                        )
                    )
        except EngineDeadError as e:
            yield sse(error_body(str(e), 503))
            yield SSE_DONE
            return
        finally:
            await outputs.aclose()
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        if include_usage:
            yield sse(
                CompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=_usage(prompt_tokens, choices),
                )
            )
        yield SSE_DONE


def _usage_counts(prompt_tokens: list[int], choices: list[_Choice]) -> tuple[int, int]:
    return sum(prompt_tokens), sum(ch.num_tokens for ch in choices)


def _usage(prompt_tokens: list[int], choices: list[_Choice]) -> UsageInfo:
    prompt, completion = _usage_counts(prompt_tokens, choices)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def check_unsupported(request: CompletionRequest) -> None:
    """A 400 naming each field that is set but that this server cannot honour, rather
    than an answer that silently ignores it."""
    if request.suffix:
        raise OpenAIError("suffix: is not supported", 400, "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise OpenAIError(
            f"best_of: only best_of equal to n ({request.n}) is supported, got {request.best_of}",
            400,
            "best_of",
        )
    if request.max_tokens == 0 and not request.echo:
        raise OpenAIError("max_tokens: must be >= 1 (0 only with echo)", 400, "max_tokens")
