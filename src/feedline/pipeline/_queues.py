"""The feeder threads of ``multiprocessing`` queues: not started where not needed, not left behind.

A queue that this process has put on runs a feeder thread, which leaves only once it has
written what was put and seen the queue closed. A worker started next while such a thread
still runs would see a process with threads: no plain fork (the fork server instead, which
costs about 1.5 s the first time). :func:`close_queue` closes a queue and remembers its
thread; :func:`await_closed_queues` waits a little for those threads before a fork.
:func:`write_first` writes a queue's first message itself, without starting the thread.
"""

from __future__ import annotations

import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["await_closed_queues", "close_queue", "write_first"]

_FIRST_BYTES = 16 * 1024
"""The largest first message :func:`write_first` writes itself: an empty pipe takes it without
blocking (Linux pipes hold 64 KiB), whether or not the reader is there yet."""

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


def write_first(q: Any, message: Any) -> bool:
    """Write ``message`` to ``q`` on this thread if it is the queue's first, and small.

    Returns whether it did; if not, nothing was put. Then no feeder thread is started for it:
    starting one waits until the new thread runs, about 1.5 ms each on a 2-core VM whose
    cores the workers just started are using, on the way to the first batch of every worker;
    and a process with threads may not fork safely. The queue's internals are CPython's (its
    feeder, locks and pipe); where they differ, this returns ``False``.
    """
    try:
        notempty, sem, wlock, writer = q._notempty, q._sem, q._wlock, q._writer
    except AttributeError:  # pragma: no cover - not CPython's Queue
        return False
    data = bytes(ForkingPickler.dumps(message))
    with notempty:  # no put starts the feeder meanwhile
        first = q._thread is None and not q._closed and len(data) <= _FIRST_BYTES
        if not (first and sem.acquire(False)):  # as put does: get releases it
            return False
        if wlock is None:  # pragma: no cover - Windows writes without the lock
            writer.send_bytes(data)
        else:
            with wlock:
                writer.send_bytes(data)
        return True
