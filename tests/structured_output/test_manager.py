"""The manager's step bitmask and the sampler's masking, on the real stories260K
tokenizer and hand-made logits: only masked rows change, greedy rows leave the fast path,
matchers advance with each appended token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from decodegraph.sample.metadata import SamplingMetadata
from decodegraph.sample.sampler import Sampler
from decodegraph.sampling_params import StructuredOutputsParams
from decodegraph.structured_output.manager import StructuredOutputManager
from tests.utils.requests import make_request_state

VOCAB = 512
EOS = 2


@pytest.fixture(scope="module")
def manager(stories_dir: Path) -> StructuredOutputManager:
    return StructuredOutputManager(AutoTokenizer.from_pretrained(stories_dir), VOCAB, [EOS])


def _allowed(mask_row: torch.Tensor) -> set[int]:
    bits = (mask_row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:VOCAB].nonzero().flatten().tolist())


def test_only_rows_with_a_grammar_are_masked_and_greedy_leaves_the_fast_path(
    manager: StructuredOutputManager,
) -> None:
    spec = StructuredOutputsParams(choice=["cat", "dog"])
    free = make_request_state("free", temperature=0.0)
    masked = make_request_state("masked", temperature=0.0)
    masked.grammar = manager.new_grammar(spec)
    logits = torch.randn(2, VOCAB)
    md = SamplingMetadata.from_requests([free, masked], VOCAB, "cpu")
    assert md.is_fast_greedy
    md.structured_output_mask = manager.grammar_bitmask([free.grammar, masked.grammar])
    assert not md.is_fast_greedy and md.structured_output_mask.rows == [1]
    allowed = _allowed(md.structured_output_mask.bitmask[1])
    assert EOS not in allowed and len(allowed) < VOCAB
    before = logits.clone()
    out = Sampler()(logits, md)
    assert torch.equal(logits, before), "the sampler never edits its input"
    assert out.sampled_token_ids[0] == int(logits[0].argmax())
    best_allowed = max(allowed, key=lambda t: float(logits[1, t]))
    assert out.sampled_token_ids[1] == best_allowed


def test_appending_tokens_advances_the_matcher_until_only_eos_is_left(
    manager: StructuredOutputManager, stories_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    state = make_request_state("r", temperature=1.0)
    state.grammar = manager.new_grammar(StructuredOutputsParams(regex="[0-9]"))
    digit = tokenizer.convert_tokens_to_ids("<0x37>")  # the byte "7"
    state.append_output_token(digit)
    mask = manager.grammar_bitmask([state.grammar])
    assert _allowed(mask.bitmask[0]) == {EOS}
    state.append_output_token(EOS)
    assert state.grammar.is_terminated()
    # Taken again after the end (ignore_eos), EOS stays the only choice.
    assert _allowed(manager.grammar_bitmask([state.grammar]).bitmask[0]) == {EOS}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_tokens_always_lie_inside_the_mask(
    manager: StructuredOutputManager, temperature: float
) -> None:
    spec = StructuredOutputsParams(regex="[a-z]{3}")
    states = [make_request_state(str(i), temperature=temperature, seed=i) for i in range(4)]
    for s in states[::2]:
        s.grammar = manager.new_grammar(spec)
    for _ in range(3):
        md = SamplingMetadata.from_requests(states, VOCAB, "cpu")
        md.structured_output_mask = manager.grammar_bitmask([s.grammar for s in states])
        tokens = Sampler()(torch.randn(4, VOCAB), md).sampled_token_ids
        for row in md.structured_output_mask.rows:
            assert tokens[row] in _allowed(md.structured_output_mask.bitmask[row])
        for s, t in zip(states, tokens, strict=True):
            s.append_output_token(t)


def test_a_slow_compile_does_not_hold_up_lookups_of_compiled_grammars(
    manager: StructuredOutputManager,
) -> None:
    """The engine thread's cache hits never wait for another thread's compile."""
    import threading
    import time

    cached = StructuredOutputsParams(regex="[xy]")
    manager.compile(cached)
    started, release = threading.Event(), threading.Event()
    backend = manager.backend
    original = backend.compile

    def slow_compile(key):  # noqa: ANN001, ANN202
        started.set()
        release.wait(10)
        return original(key)

    backend.compile = slow_compile
    try:
        worker = threading.Thread(
            target=manager.compile, args=(StructuredOutputsParams(regex="[pq]{2}"),)
        )
        worker.start()
        assert started.wait(10)
        start = time.monotonic()
        manager.compile(cached)  # at once: the other compile still waits (up to 10 s)
        assert time.monotonic() - start < 5
        release.set()
        worker.join(10)
    finally:
        release.set()
        backend.compile = original
