"""Child processes that end when the process that started them ends.

A worker of a ``ProcessPoolExecutor`` whose parent is killed (SIGKILL, the out-of-memory
killer) waits for work forever, and with it stay the fork server and the resource tracker
(which lives as long as any process holds its pipe). :func:`die_with_parent`, run first in
each child, ends the child when its parent goes: a thread waits on the parent's sentinel
(multiprocessing's pipe that closes when the parent exits, however it exits), and on Linux
the kernel also sends SIGKILL when the fork server that forked the child dies
(``PR_SET_PDEATHSIG``). Not when the parent forked or spawned the child itself: the kernel
sends that signal when the *thread* that started the child exits, and feedline starts children
from pipeline threads that end with their epoch.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from multiprocessing.connection import wait as wait_for

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """End this child process when its parent ends; call it first thing in the child.

    Pass it as a process pool's initializer so that the pool's workers do not outlive a
    killed training job::

        pool = ProcessPoolExecutor(4, mp_context=mp.get_context("forkserver"),
                                   initializer=feedline.pipeline.die_with_parent)

    feedline's own children (subprocess pipelines, DataLoader workers) do this already. Does
    nothing in a process that multiprocessing did not start.
    """
    parent = mp.parent_process()
    if parent is None:
        return
    if sys.platform.startswith("linux") and os.getppid() != parent.pid:  # a fork server's
        with contextlib.suppress(Exception):  # best effort: the sentinel below is the rule
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    sentinel = parent.sentinel

    def watch() -> None:
        wait_for([sentinel])
        # The parent is gone: nobody will read what this process makes, nor unlink the
        # shared memory it made for the parent (if it made any: feedline's children do).
        shm = sys.modules.get("feedline._proc.shm")
        if shm is not None:
            with contextlib.suppress(Exception):
                shm.abandon()
        os._exit(3)

    threading.Thread(target=watch, name="feedline-parent-watch", daemon=True).start()
