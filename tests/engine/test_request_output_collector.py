"""The per-request collector between the engine thread and a consumer: DELTA outputs
that pile up are merged, CUMULATIVE ones replaced, anything else queued in order."""

from __future__ import annotations

import asyncio

from decodegraph.engine.async_llm import RequestOutputCollector
from decodegraph.outputs import CompletionOutput, Logprob, RequestOutput
from decodegraph.sampling_params import RequestOutputKind


def _out(
    text: str,
    ids: list[int],
    *,
    index: int = 0,
    finish: str | None = None,
    logprobs: bool = False,
) -> RequestOutput:
    lps = [{t: Logprob(-1.0)} for t in ids] if logprobs else None
    completion = CompletionOutput(index, text, ids, -float(len(ids)), lps, finish)
    return RequestOutput("r", None, [1, 2], [completion], finished=finish is not None)


def _drain(collector: RequestOutputCollector, count: int) -> list:
    async def take() -> list:
        return [await collector.get() for _ in range(count)]

    return asyncio.run(take())


def test_delta_outputs_waiting_together_merge_into_one() -> None:
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    collector.put(_out(" a", [5], logprobs=True))
    collector.put(_out(" b", [6], logprobs=True))
    collector.put(_out(" c", [7], finish="length", logprobs=True))
    [merged] = _drain(collector, 1)
    [c] = merged.outputs
    assert (c.text, c.token_ids, c.finish_reason) == (" a b c", [5, 6, 7], "length")
    assert c.logprobs is not None and [list(d) for d in c.logprobs] == [[5], [6], [7]]
    assert merged.finished


def test_delta_merge_keeps_each_sequence_of_n_apart() -> None:
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    collector.put(_out("x", [1], index=1))
    collector.put(_out("y", [2], index=0))
    collector.put(_out("z", [3], index=1))
    [merged] = _drain(collector, 1)
    assert [(c.index, c.text, c.token_ids) for c in merged.outputs] == [
        (0, "y", [2]),
        (1, "xz", [1, 3]),
    ]


def test_cumulative_outputs_keep_only_the_latest() -> None:
    collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    collector.put(_out("a", [1]))
    latest = _out("ab", [1, 2])
    collector.put(latest)
    assert _drain(collector, 1) == [latest]


def test_other_items_queue_in_order_and_are_never_merged() -> None:
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    accepted, error = object(), ValueError("bad")
    collector.put(accepted)
    collector.put(_out("a", [1]))
    collector.put(error)
    collector.put(_out("b", [2]))
    got = _drain(collector, 4)
    assert got[0] is accepted and got[2] is error
    assert [got[1].outputs[0].text, got[3].outputs[0].text] == ["a", "b"]


def test_get_waits_for_a_later_put() -> None:
    async def main() -> str:
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, collector.put, _out("late", [9]))
        return (await collector.get()).outputs[0].text

    assert asyncio.run(main()) == "late"
