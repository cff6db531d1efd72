"""The hand-written text chunks are byte for byte the pydantic models' JSON."""

from __future__ import annotations

import itertools

import pytest

from decodegraph.entrypoints.openai.protocol import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
)
from decodegraph.entrypoints.openai.serving_engine import sse
from decodegraph.entrypoints.openai.stream_chunks import ChatChunkWriter, CompletionChunkWriter

# Quotes, backslashes, every control character, non-ASCII, astral and separator
# characters that JSON writers treat differently.
TEXTS = [
    "",
    " Once upon a time",
    'say "hi" \\ /',
    "".join(chr(i) for i in range(0x20)) + "\x7f",
    "héllo wörld ✓ 😀 \u2028\u2029 \ufeff \ufffd",
]
FINISHES = [(None, None), ("length", None), ("stop", None), ("stop", 2), ("stop", "\nThe end")]
USAGES = [None, (64, 0), (64, 17)]
IDS = [("cmpl-0123abc", 1764630000, "stories260K"), ('q"\\é', 0, "m/ö")]


def _usage_info(usage: tuple[int, int] | None) -> UsageInfo | None:
    if usage is None:
        return None
    return UsageInfo(prompt_tokens=usage[0], completion_tokens=usage[1], total_tokens=sum(usage))


@pytest.mark.parametrize("ids", IDS)
def test_completion_text_chunk_matches_the_model(ids: tuple[str, int, str]) -> None:
    request_id, created, model = ids
    writer = CompletionChunkWriter(request_id, created, model)
    for index, text, (finish, stop), usage in itertools.product([0, 3], TEXTS, FINISHES, USAGES):
        expected = sse(
            CompletionStreamResponse(
                id=request_id,
                created=created,
                model=model,
                choices=[
                    CompletionResponseChoice(
                        index=index, text=text, finish_reason=finish, stop_reason=stop
                    )
                ],
                usage=_usage_info(usage),
            )
        )
        assert writer.text(index, text, finish, stop, usage) == expected


@pytest.mark.parametrize("ids", IDS)
def test_chat_content_chunk_matches_the_model(ids: tuple[str, int, str]) -> None:
    request_id, created, model = ids
    writer = ChatChunkWriter(request_id, created, model)
    finishes = [*FINISHES, ("tool_calls", None)]
    for index, content, (finish, stop), usage in itertools.product(
        [0, 3], [*TEXTS, None], finishes, USAGES
    ):
        expected = sse(
            ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=model,
                choices=[
                    ChatCompletionStreamChoice(
                        index=index,
                        delta=DeltaMessage(content=content),
                        finish_reason=finish,
                        stop_reason=stop,
                    )
                ],
                usage=_usage_info(usage),
            )
        )
        assert writer.content(index, content, finish, stop, usage) == expected
