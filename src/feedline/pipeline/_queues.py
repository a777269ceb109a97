"""Closing ``multiprocessing`` queues without leaving their feeder threads behind.

A queue that this process has put on runs a feeder thread, which leaves only once it has
written what was put and seen the queue closed. A worker started next while such a thread
still runs would see a process with threads: no plain fork (the fork server instead, which
costs about 1.5 s the first time). :func:`close_queue` closes a queue and remembers its
thread; :func:`await_closed_queues` waits a little for those threads before a fork.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["await_closed_queues", "close_queue"]

_leaving: list[threading.Thread] = []
_lock = threading.Lock()


def close_queue(q: Any) -> None:
    """Close ``q`` (nothing on it is waited for at exit) and remember its feeder thread."""
    q.cancel_join_thread()  # a reader that is gone must never hold this process at exit
    q.close()
    thread = getattr(q, "_thread", None)  # multiprocessing.Queue's feeder; no public accessor
    if isinstance(thread, threading.Thread) and thread.is_alive():
        with _lock:
            _leaving[:] = [t for t in _leaving if t.is_alive()]
            _leaving.append(thread)


def await_closed_queues(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the feeder threads of closed queues to end.

    Returns whether they all did. A feeder stays while what was put on its queue has not
    reached the pipe (a full pipe whose reader is gone): the caller goes on without it.
    """
    deadline = time.monotonic() + timeout
    with _lock:
        threads = list(_leaving)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _lock:
        _leaving[:] = [t for t in _leaving if t.is_alive()]
        return not _leaving
