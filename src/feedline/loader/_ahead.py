"""How far ahead of the consumer the in-process fetcher draws batches, and when.

A batch waits for its slowest item, and batches are handed on in order: a batch whose last
item is late holds those behind it, done, until it is. Over a store with a long tail (GETs of
20 ms at the median and 200 ms at p99) a fixed few batches in flight left most of the fetch
threads idle behind such a batch. :class:`FetchAhead` is the fetch stage's source: it draws
the epoch's next batch (from the sampler, in order) only while both hold:

* the threads have room: fewer items drawn and not yet fetched than the pool's calls at once
  plus a batch (so at most about one batch queues for a thread);
* few batches are ahead: fewer batches drawn and not yet taken by the consumer than
  ``ready_most`` (``prefetch_factor``), as in PyTorch, or, while the consumer waits for a
  batch, than hold :data:`ITEMS_PER_CALL` items per call at once (never more than
  ``held_most``). A consumer slower than the fetching thus has as many batches ahead as
  PyTorch's ``prefetch_factor`` gives it; one that waits gets batches started behind a late
  one, as many as keep the threads busy, within a bound that is small where the calls are few.

Items that compute keep a few calls at once, and so only one or two batches in flight; items
that wait on a store with a tail keep every thread busy, with many batches started behind a
late one. A batch not drawn is not held anywhere: a move of fetching to worker processes
(``_move.py``) finds it in the sampler, and ``state_dict()`` counts it as not yet fetched.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

from feedline.pipeline import GatedSource

__all__ = ["ITEMS_PER_CALL", "FetchAhead"]

ITEMS_PER_CALL = 16
"""Items that may be ahead, drawn and not yet taken, per call at once, while the consumer
waits. Measured with items that sleep 20 ms at the median and 200 ms at p99 (128 calls at
once, batches of 32, epochs of 1,200 batches), against items that all sleep the same mean: 8
gave 0.6x the rate without the tail, 16 gave 0.93-0.99x, 32 no more."""


class FetchAhead(GatedSource):
    """The epoch's batches, each drawn once the threads have room and few are ahead.

    Args:
        tasks: The batches, ``(number, indices)``, in order.
        limit: The fetcher's calls at once now (read at each decision).
        batch_items: Items in a batch, where the sampler says (what a batch not yet drawn
            is counted as; a larger batch drawn raises it).
        ready_most: Batches drawn and not taken past which none is drawn while the consumer
            does not wait (``prefetch_factor``).
        held_most: Batches drawn and not taken past which none is drawn, ever (the fetch
            stage's concurrency).

    Every method is safe from any thread.

    """

    def __init__(
        self,
        tasks: Iterator[Any],
        limit: Callable[[], int],
        batch_items: int,
        ready_most: int,
        held_most: int,
    ) -> None:
        self._tasks = tasks
        self._limit = limit
        self._batch = max(1, batch_items)
        self.ready_most = max(1, ready_most)
        self.held_most = max(self.ready_most, held_most)
        self._lock = threading.Lock()
        self._wake: Callable[[], None] | None = None
        self._blocked = False  # ready() said no: wake the source stage once it may go on
        self.items = 0
        """Items drawn and not yet fetched."""
        self.drawn = 0
        """Batches drawn."""
        self.taken = 0
        """Batches the consumer took."""
        self._hungry = False  # the consumer waits for a batch now

    def __iter__(self) -> Iterator[Any]:
        for task in self._tasks:
            items = len(task[1])
            with self._lock:
                self.drawn += 1
                self.items += items
                # A batch sampler need not say its size: the largest batch drawn is it.
                self._batch = max(self._batch, items)
            yield task

    def ready(self) -> bool:
        """Whether the next batch may be drawn (the source stage asks before each)."""
        with self._lock:
            ready = self._open()
            self._blocked = not ready
            return ready

    def wake_with(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` once the next batch may be drawn, after :meth:`ready` said no."""
        self._wake = wake

    def fetched(self, items: int) -> None:
        """``items`` of a drawn batch are fetched (a fetch thread)."""
        self._change(items=-items)

    def took(self) -> None:
        """The consumer took a batch."""
        self._change(taken=1, hungry=False)

    def waits(self) -> None:
        """The consumer waits for a batch now."""
        self._change(hungry=True)

    def poke(self) -> None:
        """Something the source stage may wait for changed (the calls at once, say)."""
        self._change()

    def _change(self, items: int = 0, taken: int = 0, hungry: bool | None = None) -> None:
        # Apply a change, and wake the source stage if it stopped and may go on now (once
        # per stop): one round of the lock.
        with self._lock:
            self.items += items
            self.taken += taken
            if hungry is not None:
                self._hungry = hungry
            wake = self._blocked and self._open()
            if wake:
                self._blocked = False
        if wake and self._wake is not None:
            self._wake()

    def _open(self) -> bool:
        # Called with the lock held.
        limit = self._limit()
        if self.items >= limit + self._batch:
            return False  # the threads are busy, and a batch queues for them
        room = self.ready_most
        if self._hungry:
            room = max(room, math.ceil(ITEMS_PER_CALL * limit / self._batch))
            room = min(self.held_most, room)
        return self.drawn - self.taken < room
