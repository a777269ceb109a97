"""What a forked process inherits and must not use: held locks, and obstore's runtime.

``fork()`` copies a process's memory but only the thread that called it. Two consequences:

* A lock or semaphore is copied as it was at the fork: held, if a thread of the parent held
  it then, and with the permits the parent's threads had taken. In the child no thread will
  ever release them. :class:`PerProcess` lets an object rebuild such state, once, in the
  first call it gets in a process other than the one that built it.
* obstore runs every request on a tokio runtime whose worker threads start with the first
  request a process makes (building a store starts nothing). A child forked after that has
  a runtime whose threads do not exist, and any obstore request in it waits forever, even
  through a store built in the child. :func:`note_obstore_request` records which process
  started the runtime, before its first request; :func:`obstore_started_in` tells a forked
  child (whose copy of this module holds its parent's record) that it cannot run obstore,
  and the DataLoader that forking would leave its workers unable to.

Nothing here changes behaviour by itself: the record is a fact about the process, set once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

__all__ = ["PerProcess", "note_obstore_request", "obstore_started_in"]

_runtime_pid: int | None = None  # the process whose obstore request started the runtime
_rebuilding = threading.Lock()  # one rebuild at a time; a new one in each forked child


def _after_fork_in_child() -> None:
    # A thread of the parent may have been rebuilding at the fork: the copy would stay held.
    global _rebuilding
    _rebuilding = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def note_obstore_request() -> None:
    """Record this process as the one running obstore's runtime; call before each request.

    The first call in a process that was not forked from one that ran obstore records it;
    the others cost one comparison.
    """
    global _runtime_pid
    if _runtime_pid is None:
        _runtime_pid = os.getpid()


def obstore_started_in() -> int | None:
    """The pid of the process whose first obstore request started the runtime this one has.

    ``None``: no process did (this one may make requests, and start it). This process's
    pid: it started it (a child forked from it now cannot make requests). Another pid: this
    process was forked, directly or not, from one that had started it, and cannot make
    obstore requests at all.
    """
    return _runtime_pid


class PerProcess:
    """Which process built an object's per-process state; rebuilds it, once, in any other.

    The owner calls :meth:`check` on entry to its public methods (one ``getpid`` each, kept
    out of inner loops). In a process other than the one that built the state, the first
    call runs ``rebuild`` (other threads of that process wait for it), so that no thread
    there ever sees a lock or a semaphore as the fork left it.
    """

    __slots__ = ("_pid",)

    def __init__(self) -> None:
        self._pid = os.getpid()

    def check(self, rebuild: Callable[[], None], pid: int | None = None) -> None:
        """Run ``rebuild`` if the state was built in another process (``pid``: this one's)."""
        pid = os.getpid() if pid is None else pid
        if self._pid == pid:
            return
        with _rebuilding:
            if self._pid != pid:
                rebuild()
                self._pid = pid
