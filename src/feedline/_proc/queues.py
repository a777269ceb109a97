"""The feeder threads of ``multiprocessing`` queues: not started where not needed, not waited for.

A queue that this process has put on runs a feeder thread, which leaves once it has written
what was put and seen the queue closed. :func:`close_queue` closes a queue so that nothing
waits for that thread at exit (its reader may be gone). :func:`write_first` writes a queue's
first message itself, without starting the thread (about 1.5 ms on the way to each worker's
first batch).
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["close_queue", "write_first"]

_FIRST_BYTES = 16 * 1024
"""The largest first message :func:`write_first` writes itself: an empty pipe takes it without
blocking (Linux pipes hold 64 KiB), whether or not the reader is there yet."""


def close_queue(q: Any) -> None:
    """Close ``q``: nothing on it is waited for at exit."""
    q.cancel_join_thread()  # a reader that is gone must never hold this process at exit
    q.close()


def write_first(q: Any, message: Any) -> bool:
    """Write ``message`` to ``q`` on this thread if it is the queue's first, and small.

    Returns whether it did; if not, nothing was put. Then no feeder thread is started for it:
    starting one waits until the new thread runs, about 1.5 ms each on a 2-core VM whose
    cores the workers just started are using, on the way to the first batch of every worker.
    The queue's internals are CPython's (its
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
