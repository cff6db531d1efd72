"""A graph's compile in a forked copy of the process (graphs/forked_build.py)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from decodegraph.graphs.forked_build import (
    FORKED_BUILDS_ENV,
    forked_builds_enabled,
    run_forked,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def never() -> bool:
    return False


def test_the_childs_work_and_its_result_come_back_as_a_bool() -> None:
    assert run_forked(lambda: True, never)
    assert not run_forked(lambda: False, never)

    def fails() -> bool:
        raise RuntimeError("a failed compile")

    assert not run_forked(fails, never)


def test_what_the_child_writes_stays_in_the_child(tmp_path: Path) -> None:
    """Its memory is a copy; files are what it leaves."""
    tensor = torch.zeros(4)
    marker = tmp_path / "built"

    def work() -> bool:
        tensor.fill_(7)
        marker.write_text("done")
        return True

    assert run_forked(work, never)
    assert torch.equal(tensor, torch.zeros(4))
    assert marker.read_text() == "done"


def test_the_child_lets_go_of_the_parents_connections() -> None:
    """A socket the parent closes while the child runs closes for its peer at once."""
    ours, peer = socket.socketpair()
    peer.settimeout(30)

    def work() -> bool:
        time.sleep(0.5)
        return True

    started = time.monotonic()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(run_forked(work, never)))
    waiter.start()
    time.sleep(0.2)  # the child is running
    ours.close()
    assert peer.recv(1) == b""  # end of stream, not a wait for the child
    closed_after = time.monotonic() - started
    waiter.join()
    peer.close()
    assert result == [True]
    assert closed_after < 0.45


def test_a_cancelled_or_overlong_child_is_stopped() -> None:
    def slow() -> bool:
        time.sleep(60)
        return True

    started = time.monotonic()
    assert not run_forked(slow, lambda: time.monotonic() - started > 0.2)
    assert not run_forked(slow, never, timeout_s=0.2)
    assert time.monotonic() - started < 30


def test_a_child_past_most_of_its_time_writes_where_it_is_stuck(
    capfd: pytest.CaptureFixture[str],
) -> None:
    def stuck_here() -> bool:
        time.sleep(60)
        return True

    assert not run_forked(stuck_here, never, timeout_s=2.0)
    err = capfd.readouterr().err
    assert "Timeout (0:00:01.8" in err and "in stuck_here" in err


def test_a_child_reaped_elsewhere_counts_as_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """(A server's SIGCHLD handler may reap it first: the thread then builds itself.)"""
    waitpid = os.waitpid

    def reaped_first(pid: int, options: int) -> tuple[int, int]:
        waitpid(pid, 0)
        raise ChildProcessError(10, "No child processes")

    monkeypatch.setattr(os, "waitpid", reaped_first)
    assert not run_forked(lambda: True, never)


def test_the_switch_is_0_or_1_and_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORKED_BUILDS_ENV, "0")
    assert not forked_builds_enabled()
    monkeypatch.setenv(FORKED_BUILDS_ENV, "1")
    assert forked_builds_enabled()
    monkeypatch.setenv(FORKED_BUILDS_ENV, "yes")
    with pytest.raises(ValueError, match=FORKED_BUILDS_ENV):
        forked_builds_enabled()


def test_a_bad_switch_fails_the_start_up_naming_it(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from decodegraph.entrypoints.llm import LLM

    monkeypatch.setenv(FORKED_BUILDS_ENV, "true")
    with pytest.raises(ValueError, match=f"{FORKED_BUILDS_ENV}: must be 0 or 1"):
        LLM(str(stories_dir), max_model_len=128, max_num_seqs=8)
