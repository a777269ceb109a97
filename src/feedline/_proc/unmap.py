"""Unmapping shared-memory segments on a thread of their own, not on the one that drops them.

An array that comes from a child process views a mapped segment whose name the parent already
removed (see :mod:`.shm`), so the kernel frees the segment's pages when that mapping goes: about
1 ms for a batch of 5.6 MB on the bench machine, which is the thread that drops the last view,
the training loop, waiting. Each such array is given to :func:`hand_over` as it is mapped; when
it is garbage the mapping goes to one ``feedline-unmap`` thread, which closes it there (``munmap``
runs with the GIL released, so the training thread goes on).

The thread starts as an array is received and ends once it has had nothing to do for
:data:`IDLE_SECONDS`, so a process that no longer reads from children keeps no thread; a view
that dies while none runs takes its mapping with it, as before. It holds no lock that a forked
child could need: :mod:`.forking` lets a plain ``fork`` happen beside it, and the child starts
with no such thread and an empty queue of its own (what the parent had queued is dropped in the
child at the fork).
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
"""Seconds with nothing to unmap after which the thread ends (the next array received starts
one, for about 0.1 ms)."""
MOST_QUEUED = 64
"""Mappings waiting for the thread past which the dropping thread unmaps its own (memory stays
bounded if the thread falls behind; measured under a training loop that holds the GIL: 6 at
most)."""
CLOSE_TRIES = 1000
"""Tries, a millisecond apart, to close a mapping still exported (then it goes when dropped)."""


class _Unmapper:
    # The queue of mappings to close, whether a thread closes them, and the mappings still
    # viewed (each by the weak reference to the array that views it).
    #
    # The thread is started by ``watch`` (as an array is received), never by ``garbage``: a
    # weak reference's callback runs wherever an array dies, a garbage collection included,
    # and must neither wait nor allocate under the lock that another callback may need.

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Guards ``_running``, nothing else: its holders neither allocate nor wait, so that no
        # collection runs a callback that needs it while it is held.
        self._lock = threading.Lock()
        self._running = False
        self.viewed: dict[int, tuple[weakref.ref[Any], Any]] = {}  # by id of the ref
        self._finalizing = sys.is_finalizing  # (kept: module globals go first at exit)
        self._most = MOST_QUEUED

    def watch(self, array: Any, mapping: Any) -> None:
        ref = weakref.ref(array, _garbage)  # (an array has no hash: the ref is kept by its id)
        self.viewed[id(ref)] = (ref, mapping)
        with self._lock:
            start, self._running = not self._running, True
        if start:
            try:
                threading.Thread(target=self._run, name=THREAD_NAME, daemon=True).start()
            except BaseException as error:  # no thread: views take their mappings with them
                with self._lock:
                    self._running = False
                if not isinstance(error, RuntimeError):  # (at exit, or out of threads)
                    raise

    def garbage(self, ref: weakref.ref[Any]) -> None:
        # On the thread that dropped the array's last view: queue the mapping for the thread
        # (the array's own reference to it goes as its deallocation ends). With no thread
        # running, at exit, or past the most queued, the mapping goes here, as it would
        # without this module.
        held = self.viewed.pop(id(ref), None)
        if held is None or self._finalizing() or self._queue.qsize() >= self._most:
            return
        self._queue.put(held[1])
        del held
        with self._lock:
            running = self._running
        if not running:  # (seen after the put: a thread that stops sees the put; see _run)
            self.drop_queued()

    def drop_queued(self) -> None:
        """Drop what is queued here: each mapping goes with its last reference."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while True:
            try:
                mapping = self._queue.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    self._running = False
                # A put that saw this thread running came before the flag went down: it is
                # in the queue now. Those after it drop their own.
                if self._queue.empty():
                    return
                with self._lock:
                    resume = not self._running  # else a new thread is starting
                    self._running = True
                if not resume:
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


_unmapper: _Unmapper | None = _Unmapper()


def hand_over(array: Any, mapping: Any) -> None:
    """Close ``mapping`` on the ``feedline-unmap`` thread once ``array`` (its view) is garbage.

    ``array`` must support weak references (a NumPy array does) and hold ``mapping`` (as its
    buffer's owner), so that the mapping outlives every view of it. Starts the thread if it
    does not run; a view that dies while none runs takes its mapping with it, on its thread.
    """
    unmapper = _unmapper
    if unmapper is not None:  # (None: at exit; the view then takes its mapping with it)
        unmapper.watch(array, mapping)


def _garbage(ref: weakref.ref[Any]) -> None:
    # (Not a method: an array that a forked child copied goes to the child's unmapper.)
    unmapper = _unmapper
    if unmapper is not None:  # (None: this module's globals went, at exit)
        unmapper.garbage(ref)


def _after_fork_in_child() -> None:
    # The parent's thread is not in the child, and its lock may have been held at the fork.
    # What it had queued goes now (else the frozen thread's frame would keep it mapped here);
    # a mapping it was closing at the fork stays, as the child's copy of any live array does.
    global _unmapper
    parent = _unmapper
    fresh = _Unmapper()
    if parent is not None:
        fresh.viewed = parent.viewed  # the arrays the child copied
        parent.drop_queued()
    _unmapper = fresh


os.register_at_fork(after_in_child=_after_fork_in_child)
