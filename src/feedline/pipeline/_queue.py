"""Bounded channels between stages, safe to use from any thread, that keep statistics.

A :class:`Channel` connects exactly one producing stage to one consuming stage. Neither side ever
blocks inside the channel: ``try_put`` and ``try_get`` return at once, and the channel tells the
other side when waiting is over through the :class:`Endpoint` callbacks (``on_data`` when an item
arrives or the channel closes, ``on_space`` when a full channel drains). Each endpoint decides what
"waking up" means: a thread-pool stage submits a job, an event-loop stage resolves a future, the
consumer of the sink notifies a condition variable. This keeps the number of thread wake-ups per
item low, which is where a threaded pipeline loses its time.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from ._queue_stats import ChannelStats, ChannelTally

if TYPE_CHECKING:
    from ._growth import Growth

__all__ = ["EMPTY", "Channel", "Endpoint", "Sizes"]

_now = time.perf_counter


class _Empty:
    __slots__ = ()

    def __repr__(self) -> str:
        return "EMPTY"


EMPTY: Any = _Empty()
"""Returned by :meth:`Channel.try_get` when there is nothing to take."""


class Endpoint(Protocol):
    """What a channel calls when the other side may proceed. Must be cheap and non-blocking."""

    def on_data(self) -> None:
        """An item was put, or the channel was closed."""

    def on_space(self) -> None:
        """A channel that had refused a put has room again."""


class Sizes(Protocol):
    """Told of items put in a channel (outside its lock), to measure some of them."""

    def put(self, item: Any) -> None:
        """An item was put."""


class _Nobody:
    def on_data(self) -> None:
        pass

    def on_space(self) -> None:
        pass


class Channel:
    """A bounded FIFO between two stages.

    Args:
        name: Used in statistics and error messages.
        capacity: The most items held at once (>= 1).
        growth: Lets the channel grow (see :mod:`._growth`) within these limits; ``None``:
            the capacity is fixed.

    """

    __slots__ = (
        "_closed",
        "_consumer",
        "_growth",
        "_items",
        "_lock",
        "_low",
        "_measure_at",
        "_producer",
        "_producer_refused",
        "_tally",
        "capacity",
        "name",
        "sizes",
    )

    def __init__(self, name: str, capacity: int, growth: Growth | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"channel capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        # A refused producer is woken once the channel has drained to this level, not at the
        # first free slot: it then refills half the channel per wake-up instead of one item.
        self._low = capacity // 2
        self._lock = threading.Lock()  # guards everything below, and the tally
        self._items: deque[Any] = deque()
        self._closed = False
        self._producer_refused = False
        self._consumer: Endpoint = _Nobody()
        self._producer: Endpoint = _Nobody()
        self._tally = ChannelTally(_now())
        self._growth = growth
        self.sizes: Sizes | None = None  # measures items put, for a memory budget
        self._measure_at = -1  # the count of gets whose item is measured (-1: none)

    def connect(self, producer: Endpoint, consumer: Endpoint) -> None:
        """Set who is told about data (``consumer``) and space (``producer``)."""
        self._producer = producer
        self._consumer = consumer

    def try_put(self, item: Any) -> bool:
        """Append ``item`` unless the channel is full; never blocks.

        Returns:
            ``True`` if the item was taken. ``False`` if the channel is full (the producer's
            ``on_space`` will be called once it has drained to half) or closed (the item is
            dropped; a channel is only closed under a producer when the pipeline stops).

        """
        with self._lock:
            if self._closed:
                return False
            items = self._items
            n = len(items)
            if n >= self.capacity:
                self._producer_refused = True
                return False
            if self._tally.put(_now(), n, 1, self.capacity):
                self._filled()
            items.append(item)
        if self.sizes is not None:
            self.sizes.put(item)
        self._consumer.on_data()
        return True

    def try_put_many(self, batch: list[Any]) -> int:
        """Append as many of ``batch`` as fit, in order, in one go; never blocks.

        Cheaper per item than :meth:`try_put` for a producer that makes items in bursts: one
        lock round trip, one clock read and one ``on_data`` for all of them.

        Returns:
            How many were taken, from the front of ``batch``. Fewer than all: the channel is
            full (the producer's ``on_space`` will be called once it has drained to half) or
            closed (nothing is taken).

        """
        with self._lock:
            if self._closed:
                return 0
            items = self._items
            n = len(items)
            k = min(len(batch), self.capacity - n)
            if k < len(batch):
                self._producer_refused = True
            if k <= 0:
                return 0
            if self._tally.put(_now(), n, k, self.capacity):
                self._filled()
            items.extend(batch if k == len(batch) else itertools.islice(batch, k))
        if self.sizes is not None:
            self.sizes.put(batch[0])
        self._consumer.on_data()
        return k

    # The helpers below are called with the lock held.

    def _filled(self) -> None:
        growth = self._growth
        tally = self._tally
        if growth is not None and growth.found_full(tally.fills, tally.gets, self.capacity):
            self._measure_at = tally.gets + 1

    def _found_empty(self) -> None:
        growth = self._growth
        gets = self._tally.gets
        if growth is not None and growth.found_empty(self._tally.fills, gets):
            # Full since the consumer last found it empty: the channel's size, not the
            # producer's speed, kept the consumer waiting. The next item taken is measured
            # and decides how far the channel may grow.
            self._measure_at = gets + 1

    def try_get(self) -> Any:
        """Take the oldest item, or return :data:`EMPTY` at once if there is none."""
        with self._lock:
            items = self._items
            if not items:
                self._found_empty()
                return EMPTY
            got = self._tally.take(_now(), len(items), 1, self._closed)
            item = items.popleft()
            measure = got == self._measure_at
            doubling, wake = self._took(measure)
        if wake or measure:
            self._after_take(item, got, measure, doubling, wake)
        return item

    def try_get_many(self, limit: int) -> list[Any]:
        """Take up to ``limit`` of the oldest items in one go, or none (an empty list) at once.

        Cheaper per item than :meth:`try_get` for a consumer that handles items in bursts:
        one lock round trip and one clock read for all of them.
        """
        with self._lock:
            items = self._items
            n = len(items)
            if not n:
                self._found_empty()
                return []
            if n <= limit:
                taken = list(items)
                items.clear()
            else:
                taken = [items.popleft() for _ in range(limit)]
            k = len(taken)
            first = self._tally.take(_now(), n, k, self._closed) - k + 1
            at = self._measure_at - first  # the index of the item to measure, if taken now
            measure = 0 <= at < k
            doubling, wake = self._took(measure)
        if wake or measure:
            self._after_take(taken[at] if measure else None, first + at, measure, doubling, wake)
        return taken

    def _took(self, measure: bool) -> tuple[bool, bool]:
        # With the lock held, after a take: whether the measured item is to double the
        # channel, and whether a refused producer is to be told of room (it is, once).
        growth = self._growth
        doubling = measure and growth is not None and growth.take_doubling()
        wake = self._producer_refused and len(self._items) <= self._low
        if wake:
            self._producer_refused = False
        return doubling, wake

    def _after_take(self, item: Any, get: int, measure: bool, doubling: bool, wake: bool) -> None:
        # Outside the lock: tell the producer, then resize on the measured item.
        if wake:
            self._producer.on_space()
        if measure:
            self._adjust(item, doubling, get)

    def _adjust(self, item: Any, doubling: bool, get: int) -> None:
        # Resize as the growth decides on this item, the get-th taken: measured outside the
        # lock, since its nbytes is user code. The next measure and the back-off count from
        # this item, whether it was taken alone or in a batch.
        growth = self._growth
        assert growth is not None
        measured = self.capacity
        if doubling and not growth.allowed(measured):
            doubling = False  # not now; no back-off either, since asking again costs little
        target = growth.target(item, measured, doubling)
        with self._lock:
            capacity = self.capacity
            # Resized meanwhile (the tuner set the stage's concurrency, another consumer
            # thread measured): the target was for the capacity it had, and would undo that
            # (seen on a loaded machine: a queue put back to 32 behind 48 reads in flight).
            # The next measure decides from the new capacity.
            resized = capacity != measured
            wake = not resized and target != capacity and self._resize(target)
            if doubling and not resized:
                growth.settled(get, grew=target > capacity)
            if self._measure_at <= get:  # not asked for again meanwhile
                grown = self.capacity > growth.first
                self._measure_at = get + growth.recheck if grown else -1
        if wake:
            self._producer.on_space()

    def request_space(self) -> bool:
        """Ask to be told (``on_space``) when the channel has room.

        Returns:
            ``True`` if the channel is drained to its low-water mark (half full) or closed
            right now, in which case no call will come; ``False`` if the producer's
            ``on_space`` will be called later.

        """
        with self._lock:
            if self._closed or len(self._items) <= self._low:
                return True
            self._producer_refused = True
            return False

    def resize(self, capacity: int) -> None:
        """Hold at most ``capacity`` items from now on (>= 1); a refused producer is told of room.

        Items already held stay, even if they are more than a smaller capacity.
        """
        if capacity < 1:
            raise ValueError(f"channel capacity must be >= 1, got {capacity}")
        with self._lock:
            wake = self._resize(capacity)
        if wake:
            self._producer.on_space()

    def _resize(self, capacity: int) -> bool:
        # With the lock held. Returns whether a refused producer is to be told of room.
        n = len(self._items)
        self._tally.resized(_now(), n, self.capacity, capacity, self._closed)
        self.capacity = capacity
        self._low = capacity // 2
        wake = self._producer_refused and n <= self._low
        if wake:
            self._producer_refused = False
        return wake

    def close(self) -> None:
        """Mark the end of the stream: the producer will put nothing more."""
        self._close(drop=False)

    def abort(self) -> None:
        """Close the channel and drop what it holds (used when the pipeline stops)."""
        self._close(drop=True)

    def _close(self, drop: bool) -> None:
        with self._lock:
            if self._closed and not drop:
                return
            items = self._items
            self._tally.closed(_now(), dropped=len(items) if drop else 0)
            self._closed = True
            if drop:
                items.clear()
                self._producer_refused = False
        self._consumer.on_data()
        if drop:
            self._producer.on_space()

    # Unlocked reads of counts that only grow: a stale value is a moment old, and its
    # readers (the stall watch, the tuner's rates, the sink's delay) only compare counts
    # over time.

    @property
    def puts(self) -> int:
        """Items put so far."""
        return self._tally.puts

    @property
    def fills(self) -> int:
        """Times the channel became full."""
        return self._tally.fills

    @property
    def last_put(self) -> float:
        """``perf_counter()`` of the latest put."""
        return self._tally.last_put

    # The reads below take the lock: a side that re-checks the channel after it announced that
    # it waits then sees every put and close before the other side's unlocked check of that
    # announcement (see "Memory ordering" in the README), with or without the GIL.

    def state(self) -> tuple[int, bool]:
        """How many items it holds, and whether the producer is done, read together."""
        with self._lock:
            return len(self._items), self._closed

    @property
    def closed(self) -> bool:
        """Whether the producer is done (items may remain)."""
        with self._lock:  # not through state(): a loop stage asks at each wake-up
            return self._closed

    @property
    def exhausted(self) -> bool:
        """Closed and empty: the consumer will never get another item."""
        held, closed = self.state()
        return closed and not held

    def __len__(self) -> int:
        return self.state()[0]

    @property
    def growth(self) -> Growth | None:
        """How the channel may grow (``None``: its size is fixed, the user's)."""
        return self._growth

    def full_seconds(self) -> float:
        """Seconds the channel has been full since it was made."""
        stats = self.stats()
        return stats.full_fraction * stats.life

    def stats(self) -> ChannelStats:
        """Return a snapshot of the channel's statistics."""
        with self._lock:
            return self._tally.snapshot(_now(), len(self._items), self.capacity)
