"""Whether this process may start a child with a plain ``fork``, from the kernel's view of it.

A fork copies the calling thread alone. Whatever another thread held at that moment (a lock,
a runtime's task queue, a connection pool) stays held in the child for good, and a native
runtime whose threads are gone waits for them for ever: obstore's tokio runtime, CUDA's, gRPC's
do exactly that (their children hang at the first request, with no message). Python's
``threading.active_count()`` does not see those threads; ``/proc/self/task`` lists them all.

The rule (:func:`fork_hazards`): every thread other than the caller must be one of

- a ``multiprocessing`` queue's feeder thread, which only moves pickled bytes from its deque
  to its pipe and whose queue the child never touches (PyTorch forks beside them too);
- feedline's ``feedline-unmap`` thread (:mod:`.unmap`), which only drops mappings from a queue
  that the child makes anew;
- a native thread that carries the process's own name: the pools of OpenMP, BLAS and torch
  (torch starts one as it is imported) are made that way, and each registers fork handlers
  that rebuild them in the child, which PyTorch's DataLoader relies on.

A native thread with a name of its own (``tokio-rt-worker``, ``cuda-EvtHandlr``,
``grpc_global_tim``) belongs to a runtime that does not survive a fork, and any other Python
thread may hold a lock the child needs: then the caller should start children with the fork
server instead. Without ``/proc`` (not Linux), only the threads Python knows are judged.

In the child, what the fork copied must not be used as it was:

* A lock or semaphore is copied as it was at the fork: held, if a thread of the parent held
  it then, and with the permits the parent's threads had taken. :class:`PerProcess` lets an
  object rebuild such state, once, in the first call it gets in a process other than the one
  that built it. multiprocessing's resource tracker, with which every shared-memory segment
  is registered, has such a lock, which any thread takes that registers or unregisters a
  segment or a semaphore (a finalizer that a garbage collection runs, in a queue's feeder
  thread as well): it is made anew in each forked child.
* obstore's runtime cannot run in a process forked after its threads started (with the
  process's first request; building a store starts nothing), even through a store built in
  the child. :func:`note_obstore_request` records, before the first request, which process
  started it; :func:`obstore_started_in` tells a forked child (whose copy of the record is
  its parent's) that it cannot make requests, so that ``RemoteStore`` raises instead of
  hanging.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from multiprocessing import resource_tracker

from .unmap import THREAD_NAME as UNMAP

__all__ = ["PerProcess", "fork_hazards", "note_obstore_request", "obstore_started_in"]

_FEEDER = "QueueFeederThread"  # multiprocessing.Queue's feeder threads are named so


def _name_of(tid: int | str) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/comm") as comm:
            return comm.read().rstrip("\n")
    except OSError:  # it has just ended
        return None


def fork_hazards() -> list[str]:
    """The threads of this process that make a plain fork unsafe, each described in a phrase.

    Empty when a fork is as safe as PyTorch's (see the module's docstring).
    """
    me = threading.get_native_id()
    known = {t.native_id: t for t in threading.enumerate() if t.native_id is not None}
    hazards = [
        f"Python thread {t.name!r}"
        for tid, t in known.items()
        if tid != me and t.is_alive() and not t.name.startswith(_FEEDER) and t.name != UNMAP
    ]
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # no procfs: the threads Python knows are all there is to judge
        return hazards
    own = _name_of(os.getpid())
    for task in tasks:
        tid = int(task)
        if tid == me or tid in known:
            continue
        name = _name_of(task)
        if name is not None and name != own:
            hazards.append(f"native thread {name!r}")
    return hazards


# -- in the child ----------------------------------------------------------------------------------

_runtime_pid: int | None = None  # the process whose obstore request started the runtime
_rebuilding = threading.Lock()  # one rebuild at a time; a new one in each forked child


def _after_fork_in_child() -> None:
    # A thread of the parent may have been rebuilding at the fork: the copy would stay held.
    global _rebuilding
    _rebuilding = threading.Lock()
    # Likewise the resource tracker's lock: the child's first segment waited for it for ever
    # (a DataLoader worker, forked beside other work: its stack in ensure_running).
    lock = getattr(resource_tracker._resource_tracker, "_lock", None)
    if lock is not None and hasattr(lock, "_at_fork_reinit"):
        lock._at_fork_reinit()


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
