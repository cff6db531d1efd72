"""POST /v1/completions: plain and streamed, several prompts, n, echo, logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from decodegraph.engine.async_llm import EngineDeadError
from decodegraph.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_uuid,
)
from decodegraph.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    error_body,
    merge_streams,
    sse,
    until_disconnect,
)
from decodegraph.entrypoints.openai.structured_outputs import (
    attach_structured_outputs,
    structured_outputs_of,
)
from decodegraph.outputs import CompletionOutput, RequestOutput
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


class OpenAIServingCompletion(OpenAIServing):
    """Handler of /v1/completions."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Validate, submit one engine request per prompt, answer plain or streamed."""
        self.check_model(request.model)
        prompts = self._prompts(request.prompt)
        if request.suffix:
            raise OpenAIError("suffix: is not supported", 400, "suffix")
        if request.echo and request.logprobs is not None:
            raise OpenAIError(
                "echo: prompt logprobs (echo with logprobs) are not supported", 400, "echo"
            )
        params = self.build_params(request.to_sampling_params, RequestOutputKind.DELTA)
        spec = self.build_params(structured_outputs_of, request)
        await attach_structured_outputs(self.async_llm.engine, params, spec)
        request_id = f"cmpl-{random_uuid()}"
        streams = await self.submit(request_id, prompts, params)
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

    def _echo_text(self, prompt: str | list[int], out: RequestOutput) -> str:
        if isinstance(prompt, str):
            return prompt
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer else ""

    def _add_logprobs(self, choice: _Choice, c: CompletionOutput) -> None:
        if c.logprobs is None:
            return
        if choice.logprobs is None:
            choice.logprobs = CompletionLogProbs()
        lp = choice.logprobs
        for token_id, top in zip(c.token_ids, c.logprobs, strict=False):
            sampled = top.get(token_id)
            text = self.token_text(token_id, sampled)
            lp.tokens.append(text)
            lp.token_logprobs.append(sampled.logprob if sampled is not None else None)
            lp.top_logprobs.append({self.token_text(t, v): v.logprob for t, v in top.items()})
            lp.text_offset.append(choice.offset)
            choice.offset += len(text)

    def _update(
        self,
        choice: _Choice,
        c: CompletionOutput,
        prompt: str | list[int],
        out: RequestOutput,
        echo: bool,
    ) -> str:
        """Fold one delta into a choice; return the text this delta adds."""
        delta = c.text
        if not choice.started:
            choice.started = True
            if echo:
                delta = self._echo_text(prompt, out) + delta
                choice.offset = len(delta) - len(c.text)
        choice.text += delta
        choice.num_tokens += len(c.token_ids)
        choice.token_ids.extend(c.token_ids)
        self._add_logprobs(choice, c)
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
        choices = [_Choice() for _ in range(len(prompts) * n)]
        prompt_tokens = [0] * len(prompts)
        try:
            async for i, out in outputs:
                prompt_tokens[i] = len(out.prompt_token_ids)
                for c in out.outputs:
                    self._update(choices[i * n + c.index], c, prompts[i], out, request.echo)
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
        choices = [_Choice() for _ in range(len(prompts) * n)]
        prompt_tokens = [0] * len(prompts)
        try:
            async for i, out in outputs:
                prompt_tokens[i] = len(out.prompt_token_ids)
                for c in out.outputs:
                    k = i * n + c.index
                    choice = choices[k]
                    num_lp = len(choice.logprobs.tokens) if choice.logprobs else 0
                    delta = self._update(choice, c, prompts[i], out, request.echo)
                    if not delta and not c.token_ids and c.finish_reason is None:
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
                                )
                            ],
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
            completion_tokens = sum(ch.num_tokens for ch in choices)
            yield sse(
                CompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=UsageInfo(
                        prompt_tokens=sum(prompt_tokens),
                        completion_tokens=completion_tokens,
                        total_tokens=sum(prompt_tokens) + completion_tokens,
                    ),
                )
            )
        yield SSE_DONE
