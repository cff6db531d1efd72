"""What the completion and chat handlers share: model check, OpenAI errors, submitting
requests (all or none), merging streams, logprob text and disconnect handling."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from decodegraph.engine.async_llm import AsyncLLM, EngineDeadError
from decodegraph.entrypoints.openai.logprobs import LogprobFormatter
from decodegraph.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, StreamOptions
from decodegraph.outputs import RequestOutput
from decodegraph.sampling_params import SamplingParams

T = TypeVar("T")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*):")


class OpenAIError(Exception):
    """An error with the HTTP status and OpenAI error body it turns into."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @classmethod
    def from_value_error(cls, error: Exception) -> OpenAIError:
        """A 400 whose `param` is the field a ValueError's message starts with ("top_p: ...")."""
        message = str(error) or type(error).__name__
        match = _FIELD_PREFIX.match(message)
        return cls(message, 400, match.group(1) if match else None)


class ClientDisconnected(Exception):
    """The client went away before its answer was ready (its requests are aborted);
    the server logs one line for it and sends nothing."""


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body as a dict."""
    info = ErrorInfo(
        message=message, type=_ERROR_TYPES.get(status, "Error"), param=param, code=status
    )
    return ErrorResponse(error=info).model_dump()


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    """A JSON response carrying the OpenAI error body."""
    return JSONResponse(error_body(message, status, param), status_code=status)


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_none=False)
    else:
        data = json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    """Base of the endpoint handlers: one served model on one `AsyncLLM`."""

    # --return-tokens-as-token-ids: logprob tokens as "token_id:N" unless a request
    # says otherwise.
    return_tokens_as_token_ids: bool = False

    def __init__(self, async_llm: AsyncLLM, served_model_names: list[str]) -> None:
        self.async_llm = async_llm
        self.served_model_names = served_model_names
        self.tokenizer = async_llm.tokenizer
        self.max_model_len: int = async_llm.model_config.max_model_len

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is one of the served names (None means the first)."""
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    @staticmethod
    def build_params(make: Any, *args: Any) -> SamplingParams:
        """Call a `to_sampling_params`, turning its ValueError into a 400."""
        try:
            return make(*args)
        except (ValueError, TypeError) as e:
            raise OpenAIError.from_value_error(e) from None

    async def submit(
        self, request_id: str, prompts: list[str | list[int]], params: SamplingParams
    ) -> list[AsyncIterator[RequestOutput]]:
        """Add one engine request per prompt; if one is rejected, abort the others."""
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                stream = await self.async_llm.add_request(f"{request_id}-{i}", prompt, params)
                streams.append(self.async_llm.stream_outputs(stream))
        except BaseException as e:
            await self.async_llm.abort([f"{request_id}-{i}" for i in range(len(streams))])
            if isinstance(e, (ValueError, TypeError, OverflowError)):
                raise OpenAIError.from_value_error(e) from None
            if isinstance(e, EngineDeadError):
                raise OpenAIError(str(e), 503) from None
            raise
        return streams

    def tokenize(self, prompt: str | list[int]) -> str | dict[str, Any]:
        """A text prompt with its token ids (the engine then does not tokenize it
        again); token ids, or text without a tokenizer, as given."""
        if isinstance(prompt, str) and self.tokenizer is not None:
            return {"prompt": prompt, "prompt_token_ids": self.tokenizer.encode(prompt)}
        return prompt

    def check_max_tokens(self, max_tokens: int | None, prompt: str | list[int] | dict) -> None:
        """vLLM's 400 when the prompt and `max_tokens` together pass the context
        (rather than clamping the completion). A prompt that alone is too long gets the
        engine's own 400."""
        if max_tokens is None:
            return
        if isinstance(prompt, dict):
            prompt = prompt["prompt_token_ids"]
        if not isinstance(prompt, list):
            return
        n, limit = len(prompt), self.max_model_len
        if n < limit and max_tokens > limit - n:
            raise OpenAIError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{n} input tokens ({max_tokens} > {limit} - {n}).",
                400,
                "max_tokens",
            )

    def logprob_formatter(self, return_tokens_as_token_ids: bool | None) -> LogprobFormatter:
        """How this request's logprob tokens are written (the flag, or the request's)."""
        as_ids = return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.return_tokens_as_token_ids
        return LogprobFormatter(self.tokenizer, as_ids)


def check_stream_options(stream: bool, options: StreamOptions | None) -> None:
    """stream_options only mean something for a streamed answer (vLLM's 400)."""
    if options is not None and not stream:
        raise OpenAIError(
            "stream_options: can only be set when stream is true", 400, "stream_options"
        )


def continuous_usage(options: StreamOptions | None) -> bool:
    """Every chunk carries the usage so far (include_usage and continuous_usage_stats)."""
    return bool(options is not None and options.include_usage and options.continuous_usage_stats)


async def merge_streams(
    streams: list[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators, yielding (index, item) as items arrive.

    Closing the merged iterator (or cancelling its consumer) cancels every source, which
    closes their generators and so aborts their requests.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    done = object()
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer below
            await queue.put((i, e))
        await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting its requests) if the client goes away."""

    async def wait_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        # The client is gone; nothing will read the response.
        raise ClientDisconnected(raw_request.url.path)
    return work_task.result()
