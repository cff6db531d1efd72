"""The streamed chunks that carry only text, written as JSON strings directly.

Nearly every chunk of a stream is one choice's new text (and maybe the usage so far);
building the pydantic models for it and dumping them costs more than the rest of the
chunk's way to the socket. A writer fixes what every chunk of one stream shares once,
and writes the same bytes as `model_dump_json` of the model it stands for (tests check
it field by field). Chunks with logprobs, tool calls or prompt logprobs still go through
the models.
"""

from __future__ import annotations

from json.encoder import encode_basestring

from decodegraph.entrypoints.openai.protocol import (
    ChatCompletionStreamResponse,
    CompletionStreamResponse,
)


def _json(value: str | int | None) -> str:
    # encode_basestring (json's C encoder for ensure_ascii=False) escapes a str as
    # pydantic-core does: quotes, backslash and control characters; the rest as is.
    # json.dumps would build an encoder object on every call.
    if value is None:
        return "null"
    if isinstance(value, str):
        return encode_basestring(value)
    return str(int(value))


def _head(model: type, request_id: str, created: int, model_name: str) -> str:
    """The chunk's fields before `choices`, as `model_dump_json` writes them."""
    dumped = model(id=request_id, created=created, model=model_name, choices=[]).model_dump_json()
    return "data: " + dumped[: dumped.index('"choices":')] + '"choices":[{"index":'


def _end(
    finish_reason: str | None,
    stop_reason: int | str | None,
    usage: tuple[int, int] | None,
    choice_rest: str = "",
) -> str:
    """A chunk from its choice's finish reason on: the reasons, the choice's fields after
    stop_reason (`choice_rest`), and `usage`, (prompt, completion) tokens or None."""
    if usage is None:
        usage_json = "null"
    else:
        prompt, completion = usage
        usage_json = (
            f'{{"prompt_tokens":{prompt},"completion_tokens":{completion},'
            f'"total_tokens":{prompt + completion}}}'
        )
    return (
        f'"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}'
        f'{choice_rest}}}],"usage":{usage_json}}}\n\n'
    )


class CompletionChunkWriter:
    """One /v1/completions stream's text chunks (`CompletionStreamResponse` with one
    `CompletionResponseChoice` and no logprobs), as server-sent events."""

    def __init__(self, request_id: str, created: int, model_name: str) -> None:
        self._head = _head(CompletionStreamResponse, request_id, created, model_name)

    def text(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
        usage: tuple[int, int] | None,
    ) -> str:
        """The event for one choice's `text`; `usage` is (prompt, completion) tokens."""
        return f'{self._head}{index},"text":{_json(text)},"logprobs":null,' + _end(
            finish_reason, stop_reason, usage, ',"prompt_logprobs":null'
        )


class ChatChunkWriter:
    """One /v1/chat/completions stream's content chunks (`ChatCompletionStreamResponse`
    with one choice whose delta has content only, and no logprobs), as server-sent
    events."""

    def __init__(self, request_id: str, created: int, model_name: str) -> None:
        self._head = _head(ChatCompletionStreamResponse, request_id, created, model_name)

    def content(
        self,
        index: int,
        content: str | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        usage: tuple[int, int] | None,
    ) -> str:
        """The event for one choice's `content`; `usage` is (prompt, completion) tokens."""
        return (
            f'{self._head}{index},"delta":{{"role":null,"content":{_json(content)},'
            f'"tool_calls":[]}},"logprobs":null,' + _end(finish_reason, stop_reason, usage)
        )
