"""Unmapping shared-memory segments on a thread of their own, not on the one that drops them.

An array that comes from a child process views a mapped segment whose name the parent already
removed (see :mod:`.shm`), so the kernel frees the segment's pages when that mapping goes: about
1 ms for a batch of 5.6 MB on the bench machine, which is the thread that drops the last view,
the training loop, waiting. Each such array is given to :func:`hand_over` as it is mapped; when
it is garbage the mapping goes to one ``feedline-unmap`` thread, which closes it there (``munmap``
runs with the GIL released, so the training thread goes on).

The thread starts with the first mapping it is handed and ends once it has had nothing to do for
:data:`IDLE_SECONDS`, so a process that no longer reads from children keeps no thread. It holds
no lock that a forked child could need: :mod:`.forking` lets a plain ``fork`` happen beside it,
and the child starts with no such thread and an empty queue of its own (what the parent had
queued is unmapped in the child as that copy of the queue goes).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import weakref
from typing import Any

__all__ = ["IDLE_SECONDS", "MOST_QUEUED", "THREAD_NAME", "hand_over"]

THREAD_NAME = "feedline-unmap"
IDLE_SECONDS = 0.2
"""Seconds with nothing to unmap after which the thread ends (the next mapping starts one,
for about 0.1 ms on the thread that drops it)."""
MOST_QUEUED = 64
"""Mappings waiting for the thread past which the dropping thread unmaps its own (memory stays
bounded if the thread falls behind; measured under a training loop that holds the GIL: 6 at
most)."""
CLOSE_TRIES = 1000
"""Tries, a millisecond apart, to close a mapping still exported (then it goes when dropped)."""


class _Unmapper:
    # The queue of mappings to drop, the thread that drops them, and the mappings still viewed
    # (each by the weak reference to the array that views it).

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the thread's start and end, so no mapping is left
        self._thread: threading.Thread | None = None
        self.viewed: dict[int, tuple[weakref.ref[Any], Any]] = {}  # by id of the ref

    def garbage(self, ref: weakref.ref[Any]) -> None:
        # On the thread that dropped the array's last view: queue the mapping (the array's
        # own reference to it goes as its deallocation ends).
        held = self.viewed.pop(id(ref), None)
        if held is None or sys.is_finalizing() or self._queue.qsize() >= MOST_QUEUED:
            return  # unmapped here: at exit no thread can start; memory stays bounded
        self._queue.put(held[1])
        del held
        with self._lock:
            if self._thread is not None:
                return
            thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            try:
                thread.start()
            except RuntimeError:  # the interpreter is shutting down: unmapped here
                while not self._queue.empty():
                    self._queue.get()
                return
            self._thread = thread

    def _run(self) -> None:
        while True:
            try:
                mapping = self._queue.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    # A mapping queued after the wait ended and before this check is seen
                    # here; one queued after it finds no thread and starts one.
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            _close(mapping)
            del mapping


def _close(mapping: Any) -> None:
    # Unmaps it here. (Dropping the last reference would not do on free-threaded Python: an
    # object is freed by the thread that made it, the one that dropped the view. There, the
    # view's export of the mapping may also outlive the weak reference's callback by a few
    # microseconds, on that thread: until it goes, ``close`` refuses.)
    for _ in range(CLOSE_TRIES):
        try:
            mapping.close()
            return
        except BufferError:
            time.sleep(1e-3)


_unmapper = _Unmapper()


def hand_over(array: Any, mapping: Any) -> None:
    """Drop ``mapping`` on the ``feedline-unmap`` thread once ``array`` (its view) is garbage.

    ``array`` must support weak references (a NumPy array does) and hold ``mapping`` (as its
    buffer's owner), so that the mapping outlives every view of it.
    """
    ref = weakref.ref(array, _garbage)  # (an array has no hash: the ref is kept by its id)
    _unmapper.viewed[id(ref)] = (ref, mapping)


def _garbage(ref: weakref.ref[Any]) -> None:
    # (Not a method: an array that a forked child copied goes to the child's unmapper.)
    _unmapper.garbage(ref)


def _after_fork_in_child() -> None:
    # The parent's thread is not in the child, and its lock may have been held at the fork.
    global _unmapper
    fresh = _Unmapper()
    fresh.viewed = _unmapper.viewed  # the arrays the child copied
    _unmapper = fresh


os.register_at_fork(after_in_child=_after_fork_in_child)
