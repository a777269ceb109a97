"""Hedged reads: a second request for a read slower than most; the first whole answer wins.

A batch of a DataLoader is a fixed set of objects and waits for its slowest. A store's
latency has a long tail (a request queued behind others, a slow disk, a lost packet): at a
median of 20 ms and a p99 ten times that, nearly every batch of 32 holds one object past the
p95. Sending a second request for an object still unanswered at the p95, and taking whichever
answers first, cuts that tail for a few percent more requests (Dean and Barroso, "The Tail at
Scale", 2013). :class:`Hedger` learns the delay and keeps the budget:

* the delay is the :data:`QUANTILE` of the last :data:`SAMPLES` times to a reply's headers
  (after that a body is coming: a large object's own length is no tail); no hedge until
  :data:`LEARNED` are in, nor while the p99 is under :data:`TAIL` times the median (no tail
  to cut: every read then goes the plain way, without the hand-off a race costs);
* each read earns :data:`SHARE` of a hedge, up to :data:`BURST`; a hedge spends one: the extra
  requests stay under ``SHARE`` of the reads, whatever the store does;
* hedges must win: when fewer than :data:`WINS` of a run of :data:`JUDGED` answered first,
  hedging pauses for :data:`PAUSE` seconds. A tail of the client's own making (its cores
  busy, every reply waiting for one) is no tail a second request cuts: measured over a
  store answering every GET in 33 ms, from a process keeping 2 cores 80% busy, the times to
  headers had a p99 over twice the median, and 4 of 128 hedges won. Hedging then only
  costs: a race from a thread is a hand-off to another and back (about 0.15 ms of CPU per
  read on 2 cores), on every read while hedging is on.

The race itself is ``RemoteStore._race`` (coroutines: the loser is cancelled, its room in
the in-flight limit given back) or ``RemoteStore._race_sync`` (on :class:`Runners`, daemon
threads: a request sent from a thread cannot be dropped, so the loser runs on to its end,
unread and not sent again). Only whole-object reads without parts are hedged: a byte range,
or a large object read in parts, is not; nor local files.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "BURST",
    "IDLE",
    "JUDGED",
    "LEARNED",
    "PAUSE",
    "QUANTILE",
    "SAMPLES",
    "SHARE",
    "TAIL",
    "WINS",
    "Hedger",
    "Progress",
    "Runners",
    "due",
]

QUANTILE = 0.95
"""The reads still unanswered after this quantile of the times to headers get a hedge."""

SHARE = 0.04
"""Hedges at most, as a share of the reads (4 %)."""

BURST = 4.0
"""Hedges that may go at once after a quiet spell."""

SAMPLES = 512
"""Times to headers kept (the last ones)."""

LEARNED = 64
"""Times to headers measured before the first hedge."""

TAIL = 2.0
"""Hedge only while the p99 of the times to headers is at least this many medians."""

JUDGED = 32
"""Hedges judged together (one run after another, not a sliding window: a store whose hedges
win 45% of the time would, judged after every hedge, now and then find a run of 32 below
the bar, and pause for nothing)."""

WINS = 0.2
"""Hedging pauses when fewer than this share of a run of hedges answered first. Measured on
2 cores: a store with a tail (lognormal, p99 ten medians) saw 35-55% of its hedges win; a
store without one, from a client whose cores were busy, 0-5%."""

PAUSE = 10.0
"""Seconds hedging pauses for when hedges do not win."""

IDLE = 1.0
"""Seconds a race thread waits for work before it ends."""

_EVERY = 32  # times observed between two computations of the delay


class Hedger:
    """The delay after which a read gets a second request, and the budget for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times: deque[float] = deque(maxlen=SAMPLES)
        self._new = 0
        self._delay: float | None = None
        self._tokens = 0.0
        self._outcomes: list[bool] = []  # whether each hedge of this run answered first
        self._paused_until = 0.0  # monotonic

    def observe(self, seconds: float) -> None:
        """A request's time to its reply's headers."""
        with self._lock:
            self._times.append(seconds)
            self._new += 1
            if self._new < _EVERY or len(self._times) < LEARNED:
                return
            self._new = 0
            ordered = sorted(self._times)
        last = len(ordered) - 1
        median, p99 = ordered[last // 2], ordered[int(0.99 * last)]
        delay = ordered[int(QUANTILE * last)] if p99 >= TAIL * median else None
        with self._lock:
            self._delay = delay

    def begin(self) -> float | None:
        """A read starts: the delay after which to hedge it (``None``: not hedged)."""
        with self._lock:
            self._tokens = min(BURST, self._tokens + SHARE)
            return None if self.paused else self._delay

    def judge(self, won: bool) -> None:
        """A hedge's race ended: the hedge answered first (``won``) or not."""
        with self._lock:
            outcomes = self._outcomes
            outcomes.append(won)
            if len(outcomes) < JUDGED:
                return
            if sum(outcomes) < WINS * JUDGED:
                self._paused_until = time.monotonic() + PAUSE
            outcomes.clear()

    @property
    def paused(self) -> bool:
        """Whether hedging pauses now, its hedges having lost (see :data:`WINS`)."""
        until = self._paused_until
        return bool(until) and time.monotonic() < until  # no clock read until a pause

    def spend(self) -> bool:
        """Whether a hedge may go now (it is then counted against the budget)."""
        with self._lock:
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

    @property
    def delay(self) -> float | None:
        """The delay now (``None``: reads are not hedged, also while hedging pauses)."""
        return None if self.paused else self._delay


class Progress:
    """How far a raced request got: when it was last sent, and whether its headers came.

    ``dropped``: the race is over for it (the other request won): it stops, uncounted.
    """

    __slots__ = ("answered", "dropped", "sent")

    def __init__(self) -> None:
        self.sent: float | None = None  # perf_counter
        self.answered = False
        self.dropped = False


def due(progress: Progress, delay: float, now: float) -> float | None:
    """Seconds until a raced request is due its hedge (0: now), or ``None``: it gets none.

    None once its headers came (a body is coming). The delay runs from when it was sent:
    while the store's in-flight limit holds it back, look again a delay later.
    """
    if progress.answered:
        return None
    if progress.sent is None:
        return delay
    return max(0.0, progress.sent + delay - now)


class Runners:
    """Daemon threads for reads no one may have to wait for, started as needed.

    ``read_sync``'s races, the shards ``TarShards`` reads ahead, and ``read_sync`` on the main
    thread. Each thread ends after ``idle`` seconds (:data:`IDLE`) without work; a read left
    running (a race's loser on a stalled server, a shard read ahead of a loop that was left)
    holds up neither its caller nor exit.
    """

    def __init__(self, most: int, name: str = "feedline-hedges", idle: float = IDLE) -> None:
        self._most = most
        self._name = name
        self._idle_seconds = idle
        self._tasks: queue.SimpleQueue[
            tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None
        ]
        self._tasks = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # a token per thread waiting for work
        self._lock = threading.Lock()
        self._threads = 0

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on one of the threads; cancel the future to drop it unstarted."""
        future: Future[T] = Future()
        self._tasks.put((future, fn, args))
        if not self._idle.acquire(blocking=False):
            with self._lock:
                start = self._threads < self._most
                self._threads += start
            if start:
                threading.Thread(target=self._run, name=self._name, daemon=True).start()
        return future

    def close(self) -> None:
        """Let every thread end as soon as it has no read to run (submit no more after)."""
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._tasks.put(None)

    def _run(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=self._idle_seconds)
            except queue.Empty:
                if self._idle.acquire(blocking=False):  # no task promised to this thread
                    with self._lock:
                        self._threads -= 1
                    return
                continue
            if task is None:  # closed
                with self._lock:
                    self._threads -= 1
                return
            future, fn, args = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as error:  # the caller has it
                    future.set_exception(error)
            del task, future, fn, args  # nothing of a finished read held while idle
            self._idle.release()
