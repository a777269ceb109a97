"""Whether this process may start a child with a plain ``fork``, from the kernel's view of it.

A fork copies the calling thread alone. Whatever another thread held at that moment (a lock,
a runtime's task queue, a connection pool) stays held in the child for good, and a native
runtime whose threads are gone waits for them for ever: obstore's tokio runtime, CUDA's, gRPC's
do exactly that (their children hang at the first request, with no message). Python's
``threading.active_count()`` does not see those threads; ``/proc/self/task`` lists them all.

The rule (:func:`fork_hazards`): every thread other than the caller must be one of

- a ``multiprocessing`` queue's feeder thread, which only moves pickled bytes from its deque
  to its pipe and whose queue the child never touches (PyTorch forks beside them too);
- a native thread that carries the process's own name: the pools of OpenMP, BLAS and torch
  (torch starts one as it is imported) are made that way, and each registers fork handlers
  that rebuild them in the child, which PyTorch's DataLoader relies on.

A native thread with a name of its own (``tokio-rt-worker``, ``cuda-EvtHandlr``,
``grpc_global_tim``) belongs to a runtime that does not survive a fork, and any other Python
thread may hold a lock the child needs: then the caller should start children with the fork
server instead. Without ``/proc`` (not Linux), only the threads Python knows are judged.
"""

from __future__ import annotations

import os
import threading

__all__ = ["fork_hazards"]

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
        if tid != me and t.is_alive() and not t.name.startswith(_FEEDER)
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
