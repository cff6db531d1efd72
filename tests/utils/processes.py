"""Which processes are still running: for the no-orphans checks."""

from __future__ import annotations

import socket
import time


def live_children() -> set[int]:
    """This process's descendants that are still running: zombies left out, and
    multiprocessing's resource tracker, which the first spawned process starts and
    which lives as long as this process (a test run alone starts it itself)."""
    import psutil

    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("multiprocessing.resource_tracker" in arg for arg in child.cmdline()):
                continue
            pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def gone(pids: list[int] | set[int], within_s: float) -> bool:
    """Whether every process in `pids` has ended (or is a zombie) within `within_s`."""
    import psutil

    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def free_port_pair() -> int:
    """A port p with p and p + 1 both free on loopback (master_port and the RPC port)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports on loopback")
