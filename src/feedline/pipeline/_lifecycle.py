"""A run's stop: whether it is stopping, its first error, and the jobs its stop waits for."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["RunLifecycle"]


class RunLifecycle:
    """Where one run is between its start and its stop, safe from any thread.

    Stopping is two-phase (see ``Run``): :meth:`begin_stop` sets ``stopping``, after which no
    job is counted in; the joining thread then waits (:meth:`wait_jobs`) for the jobs counted
    before. The flags, the error and the job count share one lock (:attr:`lock`, which the
    run's worker pool shares for its threads); joining has a lock of its own
    (:attr:`join_lock`), held for as long as the join takes, which jobs ending must not wait
    for.
    """

    __slots__ = (
        "_jobs",
        "_jobs_done",
        "_stop_called",
        "error",
        "join_lock",
        "lock",
        "stopped",
        "stopping",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # One thread joins at a time, another caller waits for it. ``stopped`` (a join ran
        # to its end) is read and written only with it held.
        self.join_lock = threading.Lock()
        self.stopped = False
        # Read without the lock on the hot path (stages look before each item): it only ever
        # turns true, and a stale false costs one more item before the stage notices.
        self.stopping = False
        self._stop_called = False  # the consumer asked to stop: later errors are not recorded
        self.error: BaseException | None = None
        self._jobs = 0
        self._jobs_done = threading.Event()

    def start(self, begin: Callable[[], None]) -> bool:
        """Call ``begin`` (which starts the run's thread) unless the run is stopping.

        Under the lock, so that a stop that comes later sees what ``begin`` started.
        """
        with self.lock:
            if self.stopping:
                return False
            begin()
            return True

    def job_begin(self) -> bool:
        """Count a job that the stop must wait for; False (not counted) once stopping."""
        with self.lock:
            if self.stopping:
                return False
            self._jobs += 1
            return True

    def job_done(self) -> None:
        """A job counted by :meth:`job_begin` ended."""
        with self.lock:
            self._jobs -= 1
            done = self._jobs == 0 and self.stopping
        if done:
            self._jobs_done.set()

    def begin_stop(self, error: BaseException | None = None, asked: bool = False) -> bool:
        """Set ``stopping``; True for the call that set it.

        Args:
            error: Why the run stops: kept as the run's error if it is the first, and no
                stop was asked for before.
            asked: The consumer asked to stop (``Run.stop``, which calls this again with
                ``asked`` once the stop has begun): errors from then on are not recorded.

        """
        with self.lock:
            if error is not None and self.error is None and not self._stop_called:
                self.error = error
            self._stop_called = self._stop_called or asked
            if self.stopping:
                return False
            self.stopping = True
            if self._jobs == 0:
                self._jobs_done.set()
            return True

    def wait_jobs(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the counted jobs to end: ``None`` once they have.

        Otherwise how many are left, read without the lock: a count for a warning.
        """
        if self._jobs_done.wait(timeout):
            return None
        return self._jobs
