"""The pipeline's default thread pool.

Not a ``ThreadPoolExecutor``: the engine submits a job at every burst of items and needs no
``Future`` back (a condition variable and a re-entrant lock per call), which makes a
submission several times cheaper.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Submitter", "WorkerPool"]

_log = logging.getLogger("feedline.pipeline")

_Task = tuple[Callable[..., Any], tuple[Any, ...]]


class Submitter(Protocol):
    """Anything with ``submit(fn, *args)``: a WorkerPool or a concurrent.futures executor."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Any:
        """Schedule ``fn(*args)``."""


class WorkerPool:
    """A fixed-size pool of threads, started on demand; the thread idle last takes the next task.

    Each idle thread sleeps on a queue of its own, on a stack: a task wakes the one that went
    idle last, so a stage's jobs stay on as few threads as its calls need and the rest sleep.
    (Woken in turn, a stage of 2 calls in a pool of 16 moved its jobs over all 16 threads: on
    free-threaded Python that cost about a tenth more CPU an item than 2 threads.) Tasks that
    find no idle thread wait in submission order.

    Args:
        max_workers: The most threads the pool starts.
        name: Prefix of the threads' names.
        lock: Guards the pool's threads, idle stack and waiting tasks: its run's (the
            lifecycle's), held only for a few assignments (and to start each of the pool's
            threads) and never while another of the engine's locks is taken.

    """

    def __init__(self, max_workers: int, name: str, lock: threading.Lock) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._name = name
        self._lock = lock
        # Each thread with its inbox, listed in one step (an interrupt between two lists
        # would leave a thread that shutdown joins but never tells to end).
        self._threads: list[tuple[threading.Thread, queue.SimpleQueue[_Task | None]]] = []
        self._idle: list[queue.SimpleQueue[_Task | None]] = []  # inboxes, the latest idle last
        self._waiting: collections.deque[_Task] = collections.deque()
        self._shutdown = False
        self._told = 0  # threads sent their end (None) by shutdown

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> None:
        """Run ``fn(*args)`` in a pool thread.

        Raises:
            RuntimeError: After :meth:`shutdown`, or if a thread cannot be started (the pool
                is then as it was, and the task not queued).

        """
        task = (fn, args)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit work to a WorkerPool that was shut down")
            if self._idle:
                # Given the task before it leaves the stack: an interrupt in between leaves
                # it listed twice (a later task may then queue behind its current one), never
                # off the stack with nothing to wake it.
                self._idle[-1].put(task)
                self._idle.pop()
            else:
                self._waiting.append(task)
                if len(self._threads) < self.max_workers:
                    # Started under the lock (at most max_workers times), before it is listed:
                    # every listed thread has started, so the run's shutdown, which follows
                    # its last job, never joins one that has not. It takes the task once the
                    # lock is free, unless a thread that finished meanwhile took it first.
                    inbox: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
                    thread = threading.Thread(
                        target=self._work,
                        args=(inbox,),
                        name=f"{self._name}_{len(self._threads)}",
                        daemon=True,
                    )
                    try:
                        thread.start()
                    except BaseException as error:
                        self._waiting.pop()  # the task is not queued
                        if not isinstance(error, RuntimeError):  # a Ctrl-C in the wait for
                            self._threads.append((thread, inbox))  # it: it runs, to be ended
                        raise
                    self._threads.append((thread, inbox))

    def _work(self, inbox: queue.SimpleQueue[_Task | None]) -> None:
        task: _Task | None = None
        while True:
            if task is None:
                with self._lock:
                    if self._waiting:
                        task = self._waiting.popleft()
                    else:
                        self._idle.append(inbox)
                if task is None:
                    task = inbox.get()
                    if task is None:
                        return
            fn, args = task
            try:
                fn(*args)
            except BaseException:  # the engine's jobs catch their own errors; this is a bug
                _log.exception("unexpected error in a feedline worker thread")
            del fn, args
            task = None

    def shutdown(self, wait: bool = True) -> None:
        """Let queued work finish, then stop the threads (and join them if ``wait``).

        The run calls it under its join lock, once its last job (and so its last submission)
        has ended: no lock of the pool's is needed. A thread still ending its last task
        finds its end in its inbox when it next sleeps.
        """
        self._shutdown = True
        threads = list(self._threads)
        while self._told < len(threads):  # one each, however often an interrupt cut this short
            threads[self._told][1].put(None)
            self._told += 1
        if wait:  # every time: a join that an interrupt cut short is finished by the next call
            for thread, _ in threads:
                _join(thread)


def _join(thread: threading.Thread) -> None:
    # Join a thread that may not have begun yet (listed as a Ctrl-C cut its start short): it
    # was created and begins within moments; past 10 s it is left (a daemon).
    deadline = time.monotonic() + 10.0
    while True:
        try:
            thread.join()
            return
        except RuntimeError:  # "cannot join thread before it is started"
            if time.monotonic() > deadline:
                return
            time.sleep(1e-3)
