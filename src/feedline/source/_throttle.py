"""How many requests a store may have in flight, and when a failed request is sent again.

A store that throttles (S3's ``503 SlowDown``, a ``429 Too Many Requests`` from GCS or a
proxy, Azure's ``503 ServerBusy``) answers requests above the rate it allows with a
refusal. Retrying each refused request while as many stay in flight only earns more
refusals, until reads run out of retries. So a refusal lowers the requests in flight at
once, and they rise again while refusals stay away, on the curve TCP CUBIC uses (and the
AWS SDKs' adaptive retry mode, for its rate):

* on a refusal, ``W_max`` is what was in flight, and the limit drops to ``BETA * W_max``;
  the refusals of requests sent before that cut do not cut again;
* ``t`` seconds later the limit is ``W_max + GROWTH * (t - K) ** 3``, where
  ``K = cbrt(W_max * (1 - BETA) / GROWTH)``: quickly back near ``W_max``, slowly past it
  (where the last refusal came), then faster and faster, up to the store's
  ``max_in_flight``.

:class:`Throttle` is that limit, shared by a store's coroutines and threads in a process (a
waiting coroutine is woken on its own event loop). :class:`Attempts` decides, for one
request, whether an error is sent again and after how long: a refusal is always, until
``retry_timeout``, and is not one of the ``retries``; an error that may pass (a server
error, a dropped connection, a timeout) is, up to ``retries`` times; the rest never.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections import deque
from typing import Any

from ._failures import kind

__all__ = ["BETA", "GROWTH", "Attempts", "Throttle"]

BETA = 0.7
"""The share of the requests in flight kept at a refusal (TCP CUBIC's and the AWS SDKs')."""

GROWTH = 4.0
"""The cubic's scale, in requests per second cubed: how fast the limit comes back. A limit cut
from 10 is back at 10 after 0.9 s, and at 64 after 3.3 s."""


class _Waiter:
    __slots__ = ("cuts", "event", "future", "gone", "granted", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.future: asyncio.Future[None] | None = None if loop is None else loop.create_future()
        self.event = threading.Event() if loop is None else None
        self.granted = False
        self.gone = False  # its room passed on: its loop closed before it was woken
        self.cuts = 0  # of the throttle when it was granted


class Throttle:
    """The requests in flight to one store from this process, within a limit cut by refusals.

    Args:
        ceiling: The most requests at once (the store's ``max_in_flight``); the limit
            starts there and never goes above it.
        clock: Seconds, for the tests.

    """

    def __init__(self, ceiling: int, clock: Any = time.monotonic) -> None:
        self.ceiling = ceiling
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self._cuts = 0  # a request keeps the number of cuts it was sent under
        self._w_max = float(ceiling)
        self._floor = float(ceiling)  # the limit right after the last cut
        self._k = 0.0
        self._cut_at = 0.0

    def limit(self) -> int:
        """How many requests may be in flight now."""
        with self._lock:
            return self._limit()

    def _limit(self) -> int:
        if self._cuts == 0:
            return self.ceiling
        t = self._clock() - self._cut_at
        curve = self._w_max + GROWTH * (t - self._k) ** 3
        return int(min(self.ceiling, max(1.0, self._floor, curve)))

    @property
    def in_flight(self) -> int:
        """Requests taken and not given back."""
        return self._in_flight

    def take_sync(self) -> int:
        """Wait (this thread) for room and take it; returns the cuts so far, for `refused`."""
        with self._lock:
            if not self._waiters and self._in_flight < self._limit():
                self._in_flight += 1
                return self._cuts
            waiter = _Waiter(None)
            self._waiters.append(waiter)
        assert waiter.event is not None
        try:
            while not waiter.event.wait(self._until_rise()):
                self._regrant()
        except BaseException:  # interrupted: the room granted meanwhile is given back
            self._withdraw(waiter)
            raise
        return waiter.cuts

    async def take(self) -> int:
        """Wait (this coroutine) for room, and take it; returns the cuts so far."""
        with self._lock:
            if not self._waiters and self._in_flight < self._limit():
                self._in_flight += 1
                return self._cuts
            waiter = _Waiter(asyncio.get_running_loop())
            self._waiters.append(waiter)
        assert waiter.future is not None
        try:
            while not (await asyncio.wait({waiter.future}, timeout=self._until_rise()))[0]:
                self._regrant()
        except BaseException:  # cancelled: the room granted meanwhile is given back
            self._withdraw(waiter)
            raise
        return waiter.cuts

    def _until_rise(self) -> float:
        # Seconds until the limit grows past the requests in flight: a waiter then looks
        # again, as no request may end meanwhile (a cut may come while it waits). At most a
        # second, at least a millisecond.
        with self._lock:
            if self._cuts == 0:
                return 1.0
            gap = self._in_flight + 1 - self._w_max
            at = self._k + math.copysign(abs(gap / GROWTH) ** (1 / 3), gap)
            left: float = self._cut_at + at - self._clock()
            return min(1.0, max(0.001, left))

    def _regrant(self) -> None:
        with self._lock:
            woken = self._grant()
        _wake(woken, self)

    def give(self) -> None:
        """Give back the room of a request that ended (answered or not)."""
        with self._lock:
            self._in_flight -= 1
            woken = self._grant()
        _wake(woken, self)

    def refused(self, cuts: int) -> bool:
        """A request sent under ``cuts`` cuts was refused: cut the limit, unless cut since.

        Call it before :meth:`give`, so that ``W_max`` counts the refused request.
        Returns whether the limit was cut.
        """
        with self._lock:
            if cuts != self._cuts:
                return False  # sent before the last cut: that cut answered it
            self._cuts += 1
            self._w_max = float(max(1, self._in_flight))
            self._floor = max(1.0, BETA * self._w_max)
            self._k = (self._w_max * (1 - BETA) / GROWTH) ** (1 / 3)
            self._cut_at = self._clock()
            return True

    def _grant(self) -> list[_Waiter]:
        # Under the lock: room for the first waiters, in order; returns them, to be woken.
        woken: list[_Waiter] = []
        while self._waiters and self._in_flight < self._limit():
            waiter = self._waiters.popleft()
            waiter.granted = True
            waiter.cuts = self._cuts
            self._in_flight += 1
            woken.append(waiter)
        return woken

    def _withdraw(self, waiter: _Waiter) -> None:
        with self._lock:
            if waiter.gone:
                return  # its room went on already
            if not waiter.granted:
                self._waiters.remove(waiter)
                return
            self._in_flight -= 1
            woken = self._grant()
        _wake(woken, self)

    def _lost(self, waiter: _Waiter) -> None:
        # A waiter whose event loop closed before it could be woken: its room goes on.
        with self._lock:
            waiter.gone = True
            self._in_flight -= 1
            woken = self._grant()
        _wake(woken, self)


def _wake(waiters: list[_Waiter], throttle: Throttle) -> None:
    for waiter in waiters:
        if waiter.event is not None:
            waiter.event.set()
            continue
        assert waiter.loop is not None
        assert waiter.future is not None
        try:
            waiter.loop.call_soon_threadsafe(_resolve, waiter.future)
        except RuntimeError:  # its loop closed: nobody waits there any more
            throttle._lost(waiter)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Attempts:
    """The attempts of one request: whether an error is sent again, and after how long.

    Args:
        store: The :class:`~feedline.source.RemoteStore` (its ``retries``, ``retry_timeout``
            and backoff settings, and its counters).
        key: What the request reads (or, ``listing``, the prefix it lists).

    """

    def __init__(self, store: Any, key: str, counted: bool = True, listing: bool = False) -> None:
        self._store, self._key, self._counted = store, key, counted
        self._listing = listing
        self._start: float | None = None  # the first send (not the wait for room before it)
        self.retried = 0  # errors that may pass, sent again
        self.refused = 0  # refusals, sent again
        self._wait = 0.0

    def sending(self) -> None:
        """The request goes out now (its room taken)."""
        if self._start is None:
            self._start = time.monotonic()

    def after(self, error: Exception, cuts: int) -> float:
        """Seconds to wait before sending the request again; raises if it is not to be.

        ``cuts`` is what :meth:`Throttle.take` returned for the failed attempt.

        Raises:
            RemoteReadError: The error is not retried, or the retries (or the time for
                them) are spent; names the key, the cause, and the attempts made.

        """
        store = self._store
        what = kind(error, store._ob.exceptions, store.url)
        if what == "refused":
            store._count_refusal(cuts)
        start = time.monotonic() if self._start is None else self._start
        late = time.monotonic() - start >= store.retry_timeout
        if what == "final" or late or (what == "passing" and self.retried >= store.retries):
            failed = store._failed(
                self._key, error, self.retried, self.refused, self._counted, self._listing
            )
            raise failed from error
        if what == "refused":
            self.refused += 1
        else:
            self.retried += 1
            store._count_retry()
        # Decorrelated jitter: between the first wait and three times the last (or the first),
        # capped: refused requests do not all come back at once.
        backoff, cap = store._backoff
        self._wait = min(cap, random.uniform(backoff, 3 * max(backoff, self._wait)))
        return self._wait
