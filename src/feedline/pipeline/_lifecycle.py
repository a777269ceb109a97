"""A run's stop: whether it is stopping, its first error, and the jobs its stop waits for."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["RunLifecycle", "own_thread"]

_here = threading.local()  # per thread: ``job``, the run whose job it is in


def own_thread(life: RunLifecycle, on_loop: bool) -> bool:
    """Whether the calling thread is one of the run's: it would wait for itself.

    Its event loop (``on_loop``), or a thread inside one of its jobs: a stop asked for by an
    op, or by the pipeline's finalizer when a garbage collection frees it in an op or on the
    loop (seen: a pipeline in a reference cycle, collected in one of its own ops, waited for
    that op for ever).
    """
    return on_loop or getattr(_here, "job", None) is life


class RunLifecycle:
    """Where one run is between its start and its stop, safe from any thread.

    :meth:`begin_stop` sets ``stopping``, after which no job is counted in; the joining thread
    then waits (:meth:`wait_jobs`) for those counted before. The flags, the error and the job
    count share :attr:`lock` (the run's worker pool shares it too); joining holds
    :attr:`join_lock` for as long as it takes, which jobs ending must not wait for.
    """

    __slots__ = (
        "_jobs",
        "_jobs_done",
        "_stop_called",
        "error",
        "finished",
        "join_lock",
        "lock",
        "stopped",
        "stopping",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.join_lock = threading.Lock()
        self.stopped = False  # a join ran to its end (under join_lock)
        self.finished = False  # the consumer was told the epoch ended (not stopped part-way)
        # unlocked on the hot path (stages look before each item): it only turns true, and a
        # stale false costs one more item.
        self.stopping = False
        self._stop_called = False  # the consumer asked to stop: later errors are not recorded
        self.error: BaseException | None = None
        self._jobs = 0
        self._jobs_done = threading.Event()

    def start(self, begin: Callable[[], None]) -> bool:
        """Call ``begin`` unless stopping, under the lock: a later stop sees what it started."""
        with self.lock:
            if self.stopping:
                return False
            begin()
            return True

    def job_begin(self) -> bool:
        """Count a job that the stop must wait for; False (not counted) once stopping."""
        return self.start(self._count_job)

    def _count_job(self) -> None:
        self._jobs += 1

    def run_job(self, job: list[Callable[[], None]]) -> None:
        """Run a job counted by :meth:`job_begin`, marking the thread as in it meanwhile.

        ``job`` holds the function until one side takes it: this call, or :meth:`drop_job`
        (its submission was interrupted and counted it done): a job runs and is counted done
        exactly once, whether an interrupt landed before or after the executor queued it.
        """
        try:
            fn = job.pop()
        except IndexError:
            return
        outer, _here.job = getattr(_here, "job", None), self
        try:
            fn()
        finally:
            _here.job = outer
            self.job_done()

    def drop_job(self, job: list[Callable[[], None]]) -> None:
        """A submission of ``job`` failed or was interrupted: done, unless it started."""
        try:
            job.pop()
        except IndexError:
            return
        self.job_done()

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
            error: Why the run stops: kept if it is the first, and no stop was asked for.
            asked: The consumer asked to stop (``Run.stop``): later errors are not kept.

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
        """Wait up to ``timeout`` s for the counted jobs to end: ``None``, or how many are left.

        unlocked: the count is for a warning.
        """
        if self._jobs_done.wait(timeout):
            return None
        return self._jobs
