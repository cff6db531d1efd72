"""The per-request collector between the engine thread and a consumer (DELTA outputs
that pile up are merged, CUMULATIVE ones replaced, anything else queued in order), and
the per-loop mailbox that brings it what the engine thread posts."""

from __future__ import annotations

import asyncio
import threading

from decodegraph.engine.async_llm import RequestOutputCollector, _Mailbox, _RequestStream
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


def _stream(mailbox: _Mailbox, request_id: str = "r") -> _RequestStream:
    return _RequestStream(request_id, mailbox, RequestOutputKind.DELTA)


def _post_from_a_thread(mailbox: _Mailbox, items: list) -> None:
    """Post each item from another thread, as the engine thread would, one step each."""
    poster = threading.Thread(target=lambda: [mailbox.post([item]) for item in items])
    poster.start()
    poster.join()


def test_mailbox_wakes_its_loop_once_for_posts_that_pile_up() -> None:
    async def main() -> tuple[int, list]:
        loop = asyncio.get_running_loop()
        wakes = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counting(callback: object, *args: object) -> object:
            nonlocal wakes
            wakes += callback == mailbox.drain  # the executor's own wake-ups aside
            return call_soon_threadsafe(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        mailbox = _Mailbox(loop)
        stream = _stream(mailbox)
        posted = [object(), _out("a", [1]), _out("b", [2])]
        _post_from_a_thread(mailbox, [(stream, item) for item in posted])  # the loop is busy
        got = [await stream.collector.get() for _ in range(2)]
        _post_from_a_thread(mailbox, [(stream, _out("c", [3]))])
        got.append(await stream.collector.get())
        return wakes, got

    wakes, got = asyncio.run(main())
    # One wake-up for the first three posts, one for the post after the drain.
    assert wakes == 2
    assert [o.outputs[0].text for o in got[1:]] == ["ab", "c"]


def test_mailbox_keeps_the_order_of_every_stream_on_its_loop() -> None:
    accepted = object()

    async def main() -> list:
        mailbox = _Mailbox(asyncio.get_running_loop())
        first, second = _stream(mailbox, "a"), _stream(mailbox, "b")
        mailbox.post([(first, _out("x", [1]))])
        mailbox.post([(second, accepted)])  # accepted while the first's output waits
        mailbox.post([(second, _out("y", [2])), (first, _out("z", [3]))])
        return [
            await second.collector.get(),
            (await second.collector.get()).outputs[0].text,
            (await first.collector.get()).outputs[0].text,
        ]

    got = asyncio.run(main())
    assert got[0] is accepted and got[1:] == ["y", "xz"]


def test_mailbox_of_a_closed_loop_drops_what_is_posted() -> None:
    loop = asyncio.new_event_loop()
    mailbox = _Mailbox(loop)
    loop.close()
    stream = _stream(mailbox)
    mailbox.post([(stream, _out("a", [1]))])
    mailbox.post([(stream, _out("b", [2]))])
    mailbox.drain()
    assert not stream.collector._items
