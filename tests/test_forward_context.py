"""The forward context is per thread: a graph traced on a thread of its own does not see
(or change) the context of the thread that steps."""

from __future__ import annotations

import threading
from unittest.mock import Mock

from decodegraph.forward_context import ForwardContext, get_forward_context, set_forward_context


def test_a_context_set_on_one_thread_is_not_seen_on_another() -> None:
    ours, theirs = ForwardContext(Mock(), params_id=1), ForwardContext(Mock(), params_id=2)
    seen: list[ForwardContext | None] = []
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        seen.append(get_forward_context())
        with set_forward_context(theirs):
            inside.set()
            release.wait()
            seen.append(get_forward_context())
        seen.append(get_forward_context())

    with set_forward_context(ours):
        thread = threading.Thread(target=other)
        thread.start()
        inside.wait()
        assert get_forward_context() is ours
        release.set()
        thread.join()
        assert get_forward_context() is ours
    assert get_forward_context() is None
    assert seen == [None, theirs, None]
