"""A thread pool whose number of running jobs can change while it runs.

The batch fetcher admits more or fewer ``dataset[i]`` calls at once as it learns whether they
wait on I/O or use the CPU. Blocking surplus threads at a gate would cost a thread wake-up at
every hand-over (50 to 400 µs on a small VM); here a thread that finishes a job takes the next
one itself whenever the limit allows, and only threads beyond the limit sleep.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from feedline._grace import stop_grace

__all__ = ["LimitedPool", "thread_times"]

_log = logging.getLogger("feedline.loader")

T = TypeVar("T")


def thread_times() -> tuple[float, float] | None:
    """The calling thread's seconds on a core and runnable but waiting for one, so far.

    The first from the thread's CPU clock; the second from ``/proc/thread-self/schedstat``
    (Linux), whose own on-core figure lags by up to a scheduler tick for a running thread.
    ``None`` where it cannot be read. What a call's wall time holds beyond the two, it spent
    off the cores: on I/O, a sleep, a lock.
    """
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            queued = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return time.thread_time(), queued / 1e9


class LimitedPool:
    """Runs callables FIFO on up to ``max_threads`` threads, at most :attr:`limit` at once.

    Args:
        max_threads: Threads started at most (on demand).
        name: Prefix of the threads' names.

    """

    def __init__(self, max_threads: int, name: str) -> None:
        self.max_threads = max_threads
        self._name = name
        self._cond = threading.Condition()
        self._jobs: collections.deque[Callable[[], Any]] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._limit = max_threads
        self._running = 0
        self._idle = 0  # threads asleep
        self._notified = 0  # of those, woken and not yet running
        self._spawned = 0  # threads started that have not yet looked for a job
        self._closed = False
        self._left = False  # a close on Ctrl-C left threads in dataset calls: none joins them
        self._tids: list[int] = []  # the threads' ids, for their schedstat (queued_seconds)
        self._schedstat = os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")

    @property
    def limit(self) -> int:
        """Jobs allowed to run at once."""
        return self._limit

    @property
    def waiting(self) -> int:
        """Jobs submitted and not started."""
        return len(self._jobs)

    @property
    def running(self) -> int:
        """Jobs running now."""
        return self._running

    SAMPLED_THREADS = 32
    """How many threads :meth:`queued_seconds` reads (a file each: about 12 µs here)."""

    @property
    def sampled_threads(self) -> int:
        """How many threads :meth:`queued_seconds` reads now: the first ones started."""
        return min(len(self._tids), self.SAMPLED_THREADS)

    def queued_seconds(self) -> float | None:
        """Seconds the pool's first :attr:`sampled_threads` have spent runnable, waiting for a core.

        The kernel's run-queue delay per thread (``/proc/self/task/*/schedstat``, Linux). It
        grows when the cores are full, of this pool's calls or of other processes, and not
        when calls wait on I/O, a sleep, a lock or the GIL: so it tells "more calls at once
        would only queue" apart from "calls wait on something else", which this process's
        CPU time cannot when other processes share the cores. A thread's delay is added when
        it gets a core, so a window of a few ms may miss some. Only a sample of the threads
        is read (they all run the same calls): reading 128 took about 1 ms. None where it
        cannot be read.
        """
        delays = self._read_threads("schedstat", lambda text: int(text.split()[1]))
        return None if delays is None else sum(delays) / 1e9

    def running_on_cores(self) -> int | None:
        """How many of the first :attr:`sampled_threads` are on a core or waiting for one now.

        The threads' scheduler state (``R`` in ``/proc/self/task/*/stat``, Linux), read at this
        instant. A thread waiting on I/O, a sleep, a lock or the GIL is not counted. More of
        them than cores says the calls already queue for the cores, also where other processes
        hold the cores and :meth:`queued_seconds` has not been updated yet (a thread's delay is
        added only when it gets a core). None where it cannot be read.
        """
        # "pid (name) S ...": the name may hold spaces and parentheses.
        states = self._read_threads("stat", lambda text: text[text.rfind(b")") + 2 :][:1])
        return None if states is None else states.count(b"R")

    def _read_threads(self, name: str, parse: Callable[[bytes], T]) -> list[T] | None:
        # parse(/proc/self/task/<tid>/<name>) for the sampled threads; None if unreadable.
        if not self._schedstat:
            return None
        values = []
        for tid in self._tids[: self.SAMPLED_THREADS]:
            try:
                with open(f"/proc/self/task/{tid}/{name}", "rb") as f:
                    values.append(parse(f.read()))
            except FileNotFoundError:  # pragma: no cover - a thread that exited (at close)
                continue
            except (OSError, ValueError, IndexError):  # e.g. out of file descriptors
                return None
        return values

    def set_limit(self, limit: int) -> None:
        """Change how many jobs may run at once (1 to ``max_threads``)."""
        limit = max(1, min(self.max_threads, limit))
        with self._cond:
            raised = limit > self._limit
            self._limit = limit
            if raised:
                self._wake_or_spawn()

    def submit(self, job: Callable[[], Any]) -> None:
        """Queue ``job()``; it runs when a slot is free."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the fetch pool is closed")
            self._jobs.append(job)
            self._wake_or_spawn()

    def _wake_or_spawn(self) -> None:
        # Called with the lock held: start what the limit allows, waking sleepers first.
        # Threads already woken or started, on their way to a job, count: a burst of submits
        # would otherwise start a thread per submit (measured: 21 threads for a limit of 3).
        on_the_way = self._notified + self._spawned
        starting = min(len(self._jobs), self._limit - self._running) - on_the_way
        while starting > 0 and self._idle > self._notified:
            self._cond.notify()
            self._notified += 1  # a sleeper claimed, not yet awake
            starting -= 1
        while starting > 0 and len(self._threads) < self.max_threads:
            thread = threading.Thread(
                target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
            )
            self._spawned += 1
            try:
                thread.start()
            except BaseException:  # e.g. "can't start new thread": nothing is on its way
                self._spawned -= 1
                raise
            self._threads.append(thread)
            starting -= 1

    def _work(self) -> None:
        self._tids.append(threading.get_native_id())
        cond = self._cond
        with cond:
            self._spawned -= 1
            while True:
                if self._closed:
                    return
                if self._jobs and self._running < self._limit:
                    job = self._jobs.popleft()
                    self._running += 1
                    cond.release()
                    try:
                        job()
                    except BaseException:  # jobs catch their own errors; this is a bug
                        _log.exception("unexpected error in a feedline fetch thread")
                    finally:
                        cond.acquire()
                        self._running -= 1
                    continue
                self._idle += 1
                cond.wait()
                self._idle -= 1
                self._notified = max(0, self._notified - 1)

    def close(self) -> None:
        """Drop jobs not started, let running ones finish, and join the threads.

        On Ctrl-C or at exit, a job still running after a moment (``feedline._grace``) is left
        on its daemon thread: a ``dataset[i]`` that never returns holds nothing up, then or
        at a later close (the iterator's collection).
        """
        grace = stop_grace()
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()
            threads = [] if self._left else list(self._threads)
        deadline = None if grace is None else time.monotonic() + grace
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        left = sum(thread.is_alive() for thread in threads)
        if left:
            self._left = True
            _log.warning(
                "closing the DataLoader on Ctrl-C or at exit: %d thread(s) still inside "
                "dataset calls after %g s are left running (daemon threads)",
                left,
                grace,
            )
