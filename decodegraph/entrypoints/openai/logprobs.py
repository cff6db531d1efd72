"""Logprobs in the OpenAI shapes: completions' `logprobs` (tokens, token_logprobs,
top_logprobs, text_offset), chat's `logprobs.content`, and vLLM's `prompt_logprobs`.

Token strings are the engine's `Logprob.decoded_token`, each token's piece decoded in
context (engine/logprob_text.py), so a choice's tokens concatenate to its text and
`text_offset` indexes into it; with `return_tokens_as_token_ids` (vLLM's flag and
request field) they are "token_id:N", which never collide.
"""

from __future__ import annotations

from typing import Any

from decodegraph.engine.logprob_text import token_bytes
from decodegraph.entrypoints.openai.protocol import (
    ChatLogprobToken,
    ChatTopLogprob,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
)
from decodegraph.outputs import Logprob
from decodegraph.sampling_params import ALL_LOGPROBS

# What OpenAI sends for an impossible token instead of -inf (JSON has no infinity).
_MIN_LOGPROB = -9999.0


class LogprobFormatter:
    """Turns the engine's per-token Logprob dicts into the API's logprob fields."""

    def __init__(self, tokenizer: Any | None, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids or tokenizer is None

    def token(self, token_id: int, logprob: Logprob | None) -> str:
        """A token's string: its piece in context, or "token_id:N"."""
        if self.as_token_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=True)

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """Chat's `bytes`: the token's own UTF-8 bytes (a byte-fallback token's byte
        even when its piece is empty or a whole character)."""
        if text.startswith("bytes:\\x"):
            return list(bytes.fromhex(text[len("bytes:") :].replace("\\x", "")))
        if self.tokenizer is not None:
            raw = token_bytes(self.tokenizer.convert_ids_to_tokens(token_id))
            if raw is not None:
                return list(raw)
        return list(text.encode())

    def _distinct_key(self, token_id: int) -> str:
        """A key for a token whose text another top token already has (a byte-fallback
        "<0x61>" next to "a"): its bytes, else its id, so that no alternative is lost."""
        raw = token_bytes(self.tokenizer.convert_ids_to_tokens(token_id))
        if raw is not None:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return f"token_id:{token_id}"

    def extend_completion(
        self,
        out: CompletionLogProbs,
        token_ids: list[int],
        entries: list[dict[int, Logprob] | None],
        num_top: int,
        offset: int,
    ) -> int:
        """Append one entry per token to `out`: `num_top` alternatives besides the token
        (vLLM's count); an entry of None (the first prompt token) has no logprob. The
        first token starts at `offset`; returns the offset after the last."""
        for token_id, entry in zip(token_ids, entries, strict=False):
            if entry is None:
                text = self.token(token_id, None)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                own = entry.get(token_id)
                text = self.token(token_id, own)
                out.token_logprobs.append(
                    max(own.logprob, _MIN_LOGPROB) if own is not None else None
                )
                top: dict[str, float] = {}
                for j, (t, lp) in enumerate(entry.items()):
                    if j > num_top:
                        break
                    key = text if t == token_id else self.token(t, lp)
                    if key in top:
                        key = self._distinct_key(t)
                    top[key] = max(lp.logprob, _MIN_LOGPROB)
                out.top_logprobs.append(top)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
        return offset

    def chat_content(
        self, token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int
    ) -> list[ChatLogprobToken]:
        """Chat's `logprobs.content` for generated tokens, with `num_top` alternatives
        (-1: all of the entry's, the whole vocabulary for top_logprobs=-1)."""
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            own = entry.get(token_id)
            text = self.token(token_id, own)
            ranked = sorted(
                entry.items(),
                key=lambda kv: (kv[1].rank if kv[1].rank is not None else 0, -kv[1].logprob),
            )
            if num_top != ALL_LOGPROBS:
                ranked = ranked[:num_top]
            top = []
            for t, lp in ranked:
                t_text = text if t == token_id else self.token(t, lp)
                top.append(
                    ChatTopLogprob(
                        token=t_text,
                        logprob=max(lp.logprob, _MIN_LOGPROB),
                        bytes=self.token_bytes(t, t_text),
                    )
                )
            content.append(
                ChatLogprobToken(
                    token=text,
                    logprob=max(own.logprob, _MIN_LOGPROB) if own is not None else _MIN_LOGPROB,
                    bytes=self.token_bytes(token_id, text),
                    top_logprobs=top,
                )
            )
        return content


def prompt_logprobs_field(
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` response field: None first, then token id -> Logprob."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]
