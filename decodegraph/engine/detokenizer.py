"""Incremental detokenization and stop strings for one generated sequence.

Text comes from the `tokenizers` library's own `DecodeStream`, primed with the end of the
prompt so that a SentencePiece leading space ("▁") or a byte-level merge decodes exactly
as it would in `tokenizer.decode(prompt + output)`. The stream holds tokens back while
they end in an incomplete UTF-8 sequence (byte-fallback tokens such as `<0xE2>`), so a
partial character is never emitted as U+FFFD; at the end of the sequence whatever is
still held back is flushed with a plain decode.

While streaming, the last (longest stop string - 1) characters are held back so that a
delta never carries the start of a stop string that the next token completes.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from decodegraph.sampling_params import RequestOutputKind, SamplingParams

# How much of the prompt primes the stream: enough context for any merge or leading
# space rule, little enough that priming stays cheap for long prompts.
_PRIME_WINDOW = 24
# At most this many trailing prompt tokens can be an unfinished UTF-8 character.
_MAX_PARTIAL_TOKENS = 4
# Tokens before the held-back ones that give a flush its context (leading spaces).
_FLUSH_CONTEXT = 6
_REPLACEMENT = "\ufffd"


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    raise TypeError(
        f"{type(tokenizer).__name__} is not a fast tokenizer; decodegraph needs one backed "
        "by the `tokenizers` library (a tokenizer.json)"
    )


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text as they arrive, and finds stop strings.

    `spaces_between_special_tokens` has no effect: fast tokenizers do not support it
    (as in vLLM's fast path).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self._backend = backend_tokenizer(tokenizer)
        self._skip_special = params.skip_special_tokens
        self._stop: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        # Nothing needs holding back when the stop string goes out with the text anyway.
        self.stop_buffer_length = (
            self._max_stop_len - 1 if self._stop and not self._include_stop else 0
        )
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self.stopped = False
        # Tokens of the last update() past the one that completed a stop string.
        self.num_dropped = 0
        # With no stop strings and only the final text wanted (LLM.generate), tokens are
        # fed to the stream when the text is asked for: the same stream steps in the same
        # order, without per-step Python around each.
        self._deferred = params.output_kind is RequestOutputKind.FINAL_ONLY and not self._stop
        self._num_fed = 0  # output tokens given to the stream so far
        self._num_held = 0  # output tokens fed to the stream and not yet in output_text
        self._last_output_offset = 0
        self._stream = self._primed_stream(prompt_token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)

    def _primed_stream(self, prompt_token_ids: list[int]) -> DecodeStream:
        window = list(prompt_token_ids[-_PRIME_WINDOW:])
        # Trailing tokens of an unfinished character: fed after priming, so the character
        # appears in the output once the model completes it.
        partial: list[int] = []
        while window and len(partial) < _MAX_PARTIAL_TOKENS:
            if not self._decode(window).endswith(_REPLACEMENT):
                break
            partial.insert(0, window.pop())
        if partial and self._decode(window).endswith(_REPLACEMENT):
            # Not an unfinished character after all, just invalid bytes: keep them.
            window += partial
            partial = []
        # Leading continuation bytes cut off by the window would decode as U+FFFD.
        while window and self._decode(window).startswith(_REPLACEMENT):
            window.pop(0)
        self._prompt_tail = window + partial
        stream = DecodeStream(window, skip_special_tokens=self._skip_special)
        for token_id in partial:
            stream.step(self._backend, token_id)
        return stream

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add new output tokens; return the stop string they completed, if any (the text
        is then cut before it, or after it with `include_stop_str_in_output`). Of several
        tokens (a multi-step batch's), those after the one completing a stop string are
        not taken: `num_dropped` says how many."""
        self.num_dropped = 0
        if self.stopped:
            return None
        if len(new_token_ids) > 1 and self._stop:
            for j, token_id in enumerate(new_token_ids):
                stop = self.update([token_id])
                if stop is not None:
                    self.num_dropped = len(new_token_ids) - j - 1
                    return stop
            return None
        self.output_token_ids += new_token_ids
        if self._deferred:
            return None
        length_before = len(self.output_text)
        self._feed()
        if not self._stop or len(self.output_token_ids) < self._min_tokens:
            return None
        return self._check_stop_strings(len(self.output_text) - length_before)

    def _feed(self) -> None:
        """Step the stream through the output tokens it has not seen yet."""
        ids = self.output_token_ids
        while self._num_fed < len(ids):
            piece = self._step(ids[self._num_fed])
            self._num_fed += 1
            if piece is None:
                self._num_held += 1
            else:
                self.output_text += piece
                self._num_held = 0

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as e:
            # Invalid byte sequences can change how already-emitted bytes decode (a
            # valid byte followed by a stray continuation byte becomes U+FFFD too), and
            # the stream refuses to rewrite its prefix. Emitted text cannot be taken
            # back either, so restart the stream from the tokens not yet emitted.
            if "Invalid prefix" not in str(e):
                raise
        self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        fed = self.output_token_ids[: self._num_fed + 1]  # token_id is the last of these
        held = fed[len(fed) - 1 - self._num_held : -1]
        for held_id in held:
            self._stream.step(self._backend, held_id)
        return self._stream.step(self._backend, token_id)

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        if num_new_chars <= 0:
            return None
        text = self.output_text
        # A match must end inside the new characters.
        start = max(0, len(text) - num_new_chars - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = text[: index + len(stop) if self._include_stop else index]
        self.stopped = True
        return stop

    def _flush(self) -> None:
        """Decode tokens the stream still holds (an unfinished or invalid byte sequence
        at the very end), as `tokenizer.decode` would render them."""
        if self._num_held == 0 or self.stopped:
            return
        held = self.output_token_ids[-self._num_held :]
        emitted = self._prompt_tail + self.output_token_ids[: -self._num_held]
        context = emitted[-_FLUSH_CONTEXT:]
        prefix = self._decode(context)
        full = self._decode(context + held)
        # Invalid bytes can re-render the context too; then decode the held part alone.
        self.output_text += full[len(prefix) :] if full.startswith(prefix) else self._decode(held)
        self._num_held = 0

    def _decode_whole(self) -> None:
        """A deferred sequence's text in one decode where that is what the stream would
        give: every byte sequence valid, the prompt's tail a clean prefix of it (the
        stream's pieces then add up to exactly this; tests check it on random ids).
        Otherwise the stream steps through the tokens as usual."""
        prefix = self._decode(self._prompt_tail)
        full = self._decode(self._prompt_tail + self.output_token_ids)
        if _REPLACEMENT in full or not full.startswith(prefix):
            return
        self.output_text = full[len(prefix) :]
        self._num_fed = len(self.output_token_ids)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it, or (`delta`) what is new since the previous
        call; unless `finished`, the stop-string hold-back is left out."""
        if finished and self._deferred and self._num_fed == 0:
            self._decode_whole()
        self._feed()
        if finished:
            self._flush()
            length = len(self.output_text)
        else:
            length = max(0, len(self.output_text) - self.stop_buffer_length)
        if not delta:
            return self.output_text[:length]
        start = min(self._last_output_offset, length)
        self._last_output_offset = max(self._last_output_offset, length)
        return self.output_text[start:length]
