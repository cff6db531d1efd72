"""POST /v1/chat/completions: messages through the chat template, plain and streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from decodegraph.engine.async_llm import AsyncLLM, EngineDeadError
from decodegraph.entrypoints.openai.chat_tools import ChatTools, template_tool_fields
from decodegraph.entrypoints.openai.logprobs import LogprobFormatter, prompt_logprobs_field
from decodegraph.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
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
from decodegraph.entrypoints.openai.stream_chunks import ChatChunkWriter
from decodegraph.entrypoints.openai.structured_outputs import (
    attach_structured_outputs,
    structured_outputs_of,
)
from decodegraph.entrypoints.openai.tool_parsers import get_tool_parser
from decodegraph.outputs import CompletionOutput, RequestOutput
from decodegraph.sampling_params import RequestOutputKind


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file path, or the Jinja template itself (as vLLM)."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass  # a template string too long to be a file name
    return value


class OpenAIServingChat(OpenAIServing):
    """Handler of /v1/chat/completions."""

    def __init__(
        self,
        async_llm: AsyncLLM,
        served_model_names: list[str],
        chat_template: str | None = None,
        enable_auto_tools: bool = False,
        tool_parser: str | None = None,
    ) -> None:
        super().__init__(async_llm, served_model_names)
        self.chat_template = chat_template
        self.enable_auto_tools = enable_auto_tools
        # Parsers keep no state between calls: one serves every request.
        self.tool_parser = get_tool_parser(tool_parser)() if tool_parser else None

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        """Render the conversation, submit it, answer plain or streamed."""
        self.check_model(request.model)
        if request.top_logprobs and not request.logprobs:
            raise OpenAIError("top_logprobs: requires logprobs to be true", 400, "top_logprobs")
        check_stream_options(request.stream, request.stream_options)
        for name in request.unsupported_fields():
            raise OpenAIError(f"{name}: is not supported by this server", 400, name)
        tools = ChatTools(request, self.enable_auto_tools, self.tool_parser)
        prompt = self._render(request, tools.template_tools())
        params = self.build_params(request.to_sampling_params, RequestOutputKind.DELTA)
        spec = tools.structured_outputs() or self.build_params(structured_outputs_of, request)
        await attach_structured_outputs(self.async_llm.engine, params, spec)
        prompt = self.tokenize(prompt)
        self.check_max_tokens(request.max_completion_tokens or request.max_tokens, prompt)
        request_id = f"chatcmpl-{random_uuid()}"
        streams = await self.submit(request_id, [prompt], params)
        outputs = merge_streams(streams)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, outputs, tools), media_type="text/event-stream"
            )
        return await until_disconnect(raw_request, self._full(request, request_id, outputs, tools))

    def _render(self, request: ChatCompletionRequest, tools: list[dict] | None = None) -> str:
        messages = []
        for k, m in enumerate(request.messages):
            if isinstance(m.content, list):
                parts = []
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise OpenAIError(
                            f"messages[{k}].content: only text parts are supported, "
                            f"got type {part.type!r}",
                            400,
                            "messages",
                        )
                    parts.append(part.text)
                content = "\n".join(parts)
            else:
                content = m.content or ""
            message = {"role": m.role, "content": content, **template_tool_fields(m)}
            if m.name is not None:
                message["name"] = m.name  # for templates that render it (vLLM passes it)
            messages.append(message)
        try:
            return self.async_llm.engine.apply_chat_template(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                chat_template=self.chat_template,
                tools=tools,
            )
        except ValueError as e:
            # The engine's message for a tokenizer without a template; say how to fix it.
            raise OpenAIError(
                f"messages: this model has no chat template ({e}); start the server with "
                "--chat-template FILE_OR_STRING",
                400,
                "messages",
            ) from None
        except Exception as e:  # noqa: BLE001 - Jinja errors (raise_exception, bad roles)
            raise OpenAIError(f"messages: the chat template failed: {e}", 400, "messages") from None

    def _logprobs(
        self, c: CompletionOutput, top_n: int, fmt: LogprobFormatter
    ) -> ChatChoiceLogprobs | None:
        if c.logprobs is None:
            return None
        return ChatChoiceLogprobs(content=fmt.chat_content(c.token_ids, c.logprobs, top_n))

    async def _full(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        tools: ChatTools,
    ) -> ChatCompletionResponse:
        n = request.n
        texts = [""] * n
        lps: list[ChatChoiceLogprobs | None] = [None] * n
        finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n
        num_tokens = [0] * n
        prompt_tokens = 0
        top_n = request.top_logprobs or 0
        fmt = self.logprob_formatter(request.return_tokens_as_token_ids)
        prompt_logprobs = None
        try:
            async for _, out in outputs:
                prompt_tokens = len(out.prompt_token_ids)
                if out.prompt_logprobs is not None and prompt_logprobs is None:
                    prompt_logprobs = prompt_logprobs_field(out.prompt_logprobs)
                for c in out.outputs:
                    texts[c.index] += c.text
                    num_tokens[c.index] += len(c.token_ids)
                    new = self._logprobs(c, top_n, fmt)
                    if new is not None:
                        if lps[c.index] is None:
                            lps[c.index] = ChatChoiceLogprobs(content=[])
                        lps[c.index].content.extend(new.content)
                    if c.finish_reason is not None:
                        finish[c.index] = (c.finish_reason, c.stop_reason)
        except EngineDeadError as e:
            raise OpenAIError(str(e), 503) from None
        completion_tokens = sum(num_tokens)
        choices = []
        for k in range(n):
            content, tool_calls, called = tools.message(texts[k])
            choices.append(
                ChatCompletionResponseChoice(
                    index=k,
                    message=ChatResponseMessage(content=content, tool_calls=tool_calls),
                    logprobs=lps[k],
                    finish_reason="tool_calls" if called else finish[k][0],
                    stop_reason=finish[k][1],
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
            prompt_logprobs=prompt_logprobs,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        tools: ChatTools,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        top_n = request.top_logprobs or 0
        fmt = self.logprob_formatter(request.return_tokens_as_token_ids)
        every_chunk_usage = continuous_usage(request.stream_options)
        writer = ChatChunkWriter(request_id, created, self.model_name)

        def chunk(
            choices: list[ChatCompletionStreamChoice],
            usage: UsageInfo | None = None,
            prompt_logprobs: PromptLogprobs | None = None,
        ) -> str:
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.model_name,
                    choices=choices,
                    usage=usage,
                    prompt_logprobs=prompt_logprobs,
                )
            )

        # The role comes first, in a chunk of its own per choice (as OpenAI sends it).
        for k in range(request.n):
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=k, delta=DeltaMessage(role="assistant", content="")
                    )
                ]
            )
        prompt_tokens = 0
        completion_tokens = 0
        tool_streams = [tools.stream() for _ in range(request.n)]
        # The prompt's logprobs come with the first output (a DELTA request's only copy).
        prompt_logprobs: PromptLogprobs | None = None
        try:
            async for _, out in outputs:
                prompt_tokens = len(out.prompt_token_ids)
                if out.prompt_logprobs is not None:
                    prompt_logprobs = prompt_logprobs_field(out.prompt_logprobs)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    ts = tool_streams[c.index]
                    delta = ts.feed(c.text, c.finish_reason is not None)
                    finish_reason = c.finish_reason
                    if finish_reason is not None and ts.called and tools.named is None:
                        finish_reason = "tool_calls"
                    if not request.logprobs and not delta.tool_calls and prompt_logprobs is None:
                        yield writer.content(
                            c.index,
                            delta.content,
                            finish_reason,
                            c.stop_reason,
                            (prompt_tokens, completion_tokens) if every_chunk_usage else None,
                        )
                        continue
                    yield chunk(
                        [
                            ChatCompletionStreamChoice(
                                index=c.index,
                                delta=DeltaMessage(
                                    content=delta.content, tool_calls=delta.tool_calls
                                ),
                                logprobs=self._logprobs(c, top_n, fmt)
                                if request.logprobs
                                else None,
                                finish_reason=finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        ],
                        UsageInfo(
                            prompt_tokens=prompt_tokens,
                            completion_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens,
                        )
                        if every_chunk_usage
                        else None,
                        prompt_logprobs,
                    )
                    prompt_logprobs = None
        except EngineDeadError as e:
            yield sse(error_body(str(e), 503))
            yield SSE_DONE
            return
        finally:
            await outputs.aclose()
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk(
                [],
                UsageInfo(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens,
                ),
            )
        yield SSE_DONE
