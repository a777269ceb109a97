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
  requests stay under ``SHARE`` of the reads, whatever the store does.

The race itself is :meth:`~feedline.source.RemoteStore._race` (coroutines; ``read_sync``
runs it on a loop thread the store starts for it, only once hedges are on): the loser is
cancelled, its room in the in-flight limit given back. Only whole-object reads without parts
are hedged: a byte range, or a large object read in parts, is not.
"""

from __future__ import annotations

import threading
from collections import deque

__all__ = ["BURST", "LEARNED", "QUANTILE", "SAMPLES", "SHARE", "TAIL", "Hedger", "Progress", "due"]

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

_EVERY = 32  # times observed between two computations of the delay


class Hedger:
    """The delay after which a read gets a second request, and the budget for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times: deque[float] = deque(maxlen=SAMPLES)
        self._new = 0
        self._delay: float | None = None
        self._tokens = 0.0

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
            return self._delay

    def spend(self) -> bool:
        """Whether a hedge may go now (it is then counted against the budget)."""
        with self._lock:
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

    @property
    def delay(self) -> float | None:
        """The delay now (``None``: reads are not hedged)."""
        return self._delay


class Progress:
    """How far a raced request got: when it was last sent, and whether its headers came."""

    __slots__ = ("answered", "sent")

    def __init__(self) -> None:
        self.sent: float | None = None  # perf_counter
        self.answered = False


def due(progress: Progress, delay: float, now: float) -> float | None:
    """Seconds until a raced request is due its hedge (0: now), or ``None``: it gets none.

    None once its headers came (a body is coming), or while it is not sent (the store's
    in-flight limit holds it back: another request would wait there too). The delay runs
    from when it was sent, not from when the read began.
    """
    if progress.answered or progress.sent is None:
        return None
    return max(0.0, progress.sent + delay - now)
