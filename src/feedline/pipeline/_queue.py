"""Bounded channels between stages, safe to use from any thread, that keep statistics.

A :class:`Channel` connects one producing stage to one consuming stage. Neither side blocks in
it: ``try_put`` and ``try_get`` return at once, and the channel calls the other side's
:class:`Endpoint` (``on_data``, ``on_space``) when waiting is over; each endpoint decides what
waking up means (a pool job, a future on the loop, the consumer's signal).
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


class _Nobody:  # the endpoints until connect()
    def on_data(self) -> None:
        pass

    on_space = on_data


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
        """Append ``item`` unless the channel is full or closed; never blocks.

        Returns:
            Whether it was taken. If full, the producer's ``on_space`` is called once the
            channel has drained to half; if closed (the pipeline stops), the item is dropped.

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
        """:meth:`try_put` for as many of ``batch`` as fit, with one lock, clock and ``on_data``.

        Returns:
            How many were taken, from the front of ``batch``.

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

    # The helpers below are called with the lock held: the growth may ask that the next item
    # taken be measured (see _growth).

    def _filled(self) -> None:
        growth, tally = self._growth, self._tally
        if growth is not None and growth.found_full(tally.fills, tally.gets, self.capacity):
            self._measure_at = tally.gets + 1

    def _found_empty(self) -> None:
        growth, tally = self._growth, self._tally
        if growth is not None and growth.found_empty(tally.fills, tally.gets):
            self._measure_at = tally.gets + 1

    def _wake(self, held: int) -> bool:
        # Whether a refused producer is to be told of room (it is, once).
        wake = self._producer_refused and held <= self._low
        if wake:
            self._producer_refused = False
        return wake

    def try_get(self, ended: Any = EMPTY) -> Any:
        """Take the oldest item, or return at once if there is none.

        Returns:
            The item; ``ended`` if the channel is exhausted (closed and empty); else
            :data:`EMPTY`. A caller that passes its own ``ended`` learns both in one lock.

        """
        with self._lock:
            items = self._items
            if not items:
                if self._closed:
                    return ended
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
        """:meth:`try_get` for up to ``limit`` items (a list, maybe empty), with one lock."""
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
        # After a take: whether the measured item is to double the channel, and _wake.
        growth = self._growth
        doubling = measure and growth is not None and growth.take_doubling()
        return doubling, self._wake(len(self._items))

    def _after_take(self, item: Any, get: int, measure: bool, doubling: bool, wake: bool) -> None:
        # Outside the lock: tell the producer, then resize on the measured item.
        if wake:
            self._producer.on_space()
        if measure:
            self._adjust(item, doubling, get)

    def _adjust(self, item: Any, doubling: bool, get: int) -> None:
        # Resize as the growth decides on this item, the get-th taken (measured outside the
        # lock: its nbytes is user code). The next measure and the back-off count from it.
        growth = self._growth
        assert growth is not None
        measured = self.capacity
        if doubling and not growth.allowed(measured):
            doubling = False  # not now; no back-off either, since asking again costs little
        target = growth.target(item, measured, doubling)
        with self._lock:
            capacity = self.capacity
            # Resized meanwhile (by the tuner, or another measure): the target would undo
            # that (seen: a queue put back to 32 behind 48 reads); the next measure decides.
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
            ``True`` if it is at most half full or closed now (no call will come).

        """
        with self._lock:
            if self._closed or len(self._items) <= self._low:
                return True
            self._producer_refused = True
            return False

    def resize(self, capacity: int) -> None:
        """Hold at most ``capacity`` items from now on (>= 1); a refused producer is told of room.

        Items already held stay, even if they are more than a smaller capacity. A channel that
        grows, resized above its first size, measures the next item taken against its byte
        budget (see :mod:`._growth`), and shrinks if its items are too large for the size.
        """
        if capacity < 1:
            raise ValueError(f"channel capacity must be >= 1, got {capacity}")
        with self._lock:
            wake = self._resize(capacity)
            if self._growth is not None and capacity > self._growth.first:
                self._measure_at = self._tally.gets + 1
        if wake:
            self._producer.on_space()

    def _resize(self, capacity: int) -> bool:
        # With the lock held; returns _wake.
        n = len(self._items)
        self._tally.resized(_now(), n, self.capacity, capacity, self._closed)
        self.capacity = capacity
        self._low = capacity // 2
        return self._wake(n)

    def abort(self) -> None:
        """Close the channel and drop what it holds (used when the pipeline stops)."""
        self.close(drop=True)

    def close(self, drop: bool = False) -> None:
        """Mark the end of the stream: the producer will put nothing more."""
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

    # unlocked: counts that only grow, whose readers (the stall watch, the tuner's rates, the
    # sink's delay) compare them over time: a stale value is a moment old.

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

    # The reads below take the lock: a side that re-checks the channel after announcing that
    # it waits sees every put and close before the other's check (see "Memory ordering").

    def state(self) -> tuple[int, bool]:
        """How many items it holds, and whether the producer is done, read together."""
        with self._lock:
            return len(self._items), self._closed

    @property
    def closed(self) -> bool:
        """Whether the producer is done (items may remain)."""
        return self.state()[1]

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
