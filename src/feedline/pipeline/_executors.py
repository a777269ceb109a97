"""The pipeline's default thread pool.

Not a ``ThreadPoolExecutor``: the engine submits a job at every burst of items and needs no
``Future`` back (a condition variable and a re-entrant lock per call), which makes a
submission several times cheaper.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Submitter", "WorkerPool"]

_log = logging.getLogger("feedline.pipeline")


class Submitter(Protocol):
    """Anything with ``submit(fn, *args)``: a WorkerPool or a concurrent.futures executor."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Any:
        """Schedule ``fn(*args)``."""


class WorkerPool:
    """A fixed-size pool of threads, started on demand, that runs callables in FIFO order.

    Args:
        max_workers: The most threads the pool starts.
        name: Prefix of the threads' names.
        lock: Guards the pool's threads and idle count: its run's (the lifecycle's), held
            only for a few assignments (and to start each of the pool's threads) and never
            while another of the engine's locks is taken.

    """

    def __init__(self, max_workers: int, name: str, lock: threading.Lock) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = lock
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for work that no submission has claimed yet
        self._shutdown = False
        self._told = 0  # threads sent their end (None) by shutdown

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> None:
        """Run ``fn(*args)`` in a pool thread.

        Raises:
            RuntimeError: After :meth:`shutdown`, or if a thread cannot be started (the pool
                is then as it was, and the task not queued).

        """
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit work to a WorkerPool that was shut down")
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self.max_workers:
                # Started under the lock (at most max_workers times), before it is listed
                # and before the task is put: once the task runs, maybe on another thread
                # that became idle meanwhile, every listed thread has started, so the run's
                # shutdown, which follows its last job, never joins one that has not.
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                try:
                    thread.start()
                except RuntimeError:  # it could not start
                    raise
                except BaseException:  # a Ctrl-C in the wait for it: it runs, to be ended
                    self._threads.append(thread)
                    raise
                self._threads.append(thread)
        self._queue.put((fn, args))

    def _work(self) -> None:
        get = self._queue.get
        while True:
            task = get()
            if task is None:
                return
            fn, args = task
            try:
                fn(*args)
            except BaseException:  # the engine's jobs catch their own errors; this is a bug
                _log.exception("unexpected error in a feedline worker thread")
            del task, fn, args
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True) -> None:
        """Let queued work finish, then stop the threads (and join them if ``wait``).

        The run calls it under its join lock, once its last job (and so its last submission)
        has ended: no lock of the pool's is needed.
        """
        self._shutdown = True
        threads = list(self._threads)
        while self._told < len(threads):  # one each, however often an interrupt cut this short
            self._queue.put(None)
            self._told += 1
        if wait:  # every time: a join that an interrupt cut short is finished by the next call
            for thread in threads:
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
