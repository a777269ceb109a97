"""The consumer's end of a pipeline: a blocking ``get`` for the user's thread."""

from __future__ import annotations

import queue
import time
from typing import Any

from feedline._watchdog import TICK, StallWatch

from .._queue import EMPTY, Channel
from .._settings import CONSUMER_SPIN

__all__ = ["SinkReader"]

_ENDED: Any = object()  # try_get's answer for a channel closed and empty


class SinkReader:
    """Reads the last channel from the consumer's thread.

    The consumer sleeps on a ``SimpleQueue`` used as a signal (cheaper than a condition
    variable): it raises ``_waiting`` and re-checks the channel before it sleeps, and a
    producer that sees ``_waiting`` puts a token. A spare token (two producers saw the flag)
    only costs one more look at the channel. Not a lock: on free-threaded Python a blocking
    acquire yields the core up to 40 times before it sleeps (measured: 42 ``sched_yield``
    calls per item with a consumer that waits for each item), where the queue's ``get``
    sleeps at once, as the pool's threads do.
    """

    def __init__(self, channel: Channel, spin: bool) -> None:
        self._channel = channel
        self._spin = spin  # whether to yield a while before sleeping (see CONSUMER_SPIN)
        self._signal: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._waiting = False
        self._interrupted = False
        self._delay = 0.0  # smoothed wait for an item, measured to its arrival (the put)
        self.watch: StallWatch | None = None  # ticked while a wait goes on

    def on_data(self) -> None:
        """An item arrived or the channel closed: wake the consumer if it sleeps."""
        if self._waiting:
            self._waiting = False
            self._signal.put(None)

    def on_space(self) -> None:
        """Unused: the consumer never puts."""

    def interrupt(self) -> None:
        """Wake the consumer so that it notices the run has failed or stopped."""
        self._interrupted = True
        self._waiting = True
        self.on_data()

    def get(self, timeout: float | None) -> Any:
        """Take the next item.

        Returns:
            The item, or :data:`EMPTY` if the channel is exhausted or the reader was
            interrupted (the caller tells which apart).

        Raises:
            TimeoutError: If nothing arrived within ``timeout`` seconds.

        """
        item = self._channel.try_get(_ENDED)
        if item is EMPTY and not self._interrupted:
            return self._wait(timeout)
        return EMPTY if item is _ENDED else item

    def _signaled(self, timeout: float) -> bool:
        # Whether a token came within ``timeout`` seconds.
        try:
            self._signal.get(timeout=timeout)
        except queue.Empty:
            return False
        return True

    def _wait(self, timeout: float | None) -> Any:
        # One lock of the channel per look: an item, its end, or empty and open (EMPTY).
        # ``get``'s look found it empty and open: the first turn goes on from there.
        channel = self._channel
        wait_began = time.monotonic()
        deadline = None if timeout is None else wait_began + timeout
        started = time.perf_counter()
        spin_until = started + CONSUMER_SPIN if self._spin and self._delay < CONSUMER_SPIN else 0.0
        item = EMPTY
        while True:
            if item is EMPTY and not self._interrupted:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no item arrived from the pipeline within {timeout} s")
                if spin_until and time.perf_counter() < spin_until:
                    time.sleep(0)
                    item = channel.try_get(_ENDED)
                    continue
                self._waiting = True
                item = channel.try_get(_ENDED)  # the re-check, after the announcement
            if item is not EMPTY or self._interrupted:
                self._waiting = False  # a token put meanwhile costs one more look, later
                if item is _ENDED:
                    return EMPTY
                if item is not EMPTY:
                    delay = max(0.0, channel.last_put - started)
                    self._delay += 0.25 * (delay - self._delay)
                return item
            watch = self.watch
            if deadline is None and watch is None:
                self._signal.get()
            else:
                # With a watch, a wake-up every TICK to tick it (the stall watchdog).
                remaining = TICK if deadline is None else deadline - time.monotonic()
                woken = remaining > 0 and self._signaled(min(remaining, TICK))
                if not woken and watch is not None:
                    watch.tick(wait_began)
            # Woken, timed out, or a spare token returned at once: lower the flag in every
            # case, or every later put would add a token for nothing.
            self._waiting = False
            item = channel.try_get(_ENDED)
