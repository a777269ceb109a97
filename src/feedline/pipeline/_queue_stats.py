"""A channel's statistics: the public snapshot, and the tally a channel keeps them in.

The tally is kept by events (puts, gets, resizes, closing): the time-integral of the fill
level is (sum of get times) - (sum of put times) + (items held) * now. Its methods are called
with the channel's lock held and the channel's clock (``perf_counter()``).
"""

from __future__ import annotations

import array
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ChannelStats", "ChannelTally", "window_share"]

_PUT, _GET, _LAST_PUT = 0, 1, 2  # ChannelTally._sums


@dataclass(frozen=True)
class ChannelStats:
    """A snapshot of one channel's statistics.

    Attributes:
        capacity: The most items the channel holds (now: a default-sized queue grows, see
            :meth:`~feedline.PipelineBuilder.add_sink` and ``pipe(buffer_size=)``).
        size: Items in the channel when the snapshot was taken.
        puts: Items put so far.
        gets: Items taken so far.
        mean_occupancy: Time-averaged fill level, 0 to 1, each moment as a share of the
            capacity at that moment.
            Near 0: the consumer is starved (its producer is the slower side); near 1: the
            producer is blocked (the consumer is slower).
        empty_fraction: Share of the channel's life it was empty while still open: the
            consumer had nothing to do because of upstream.
        full_fraction: Share of the channel's life it was full: the producer could not hand
            over results because of downstream.
        life: Seconds the shares above are over: since the channel was made, or, for a
            snapshot from :meth:`since`, between the two snapshots.

    """

    capacity: int
    size: int
    puts: int
    gets: int
    mean_occupancy: float
    empty_fraction: float
    full_fraction: float
    life: float

    def since(self, earlier: ChannelStats) -> ChannelStats:
        """The same figures over the time between ``earlier`` (a snapshot) and this one."""
        shares: dict[str, Any] = {
            name: window_share(getattr(self, name), self.life, getattr(earlier, name), earlier.life)
            for name in ("mean_occupancy", "empty_fraction", "full_fraction")
        }
        return replace(
            self,
            puts=self.puts - earlier.puts,
            gets=self.gets - earlier.gets,
            life=self.life - earlier.life,
            **shares,
        )


def window_share(share: float, life: float, earlier_share: float, earlier_life: float) -> float:
    """A share of time (0 to 1) over the window between two snapshots of shares over a life."""
    span = life - earlier_life
    if span <= 0:
        return share
    return min(1.0, max(0.0, (share * life - earlier_share * earlier_life) / span))


class ChannelTally:
    """Counts, fill level over time, and empty and full periods of one channel.

    Args:
        now: When the channel was made (``perf_counter()``).

    """

    __slots__ = (
        "_empty_since",
        "_empty_time",
        "_full_since",
        "_full_time",
        "_occupancy",
        "_occupancy_shares",
        "_sums",
        "_t0",
        "fills",
        "gets",
        "puts",
    )

    def __init__(self, now: float) -> None:
        self._t0 = now  # times below are relative to this
        # The sums of put and get times, and the perf_counter() of the latest put, updated at
        # every put and get: in an array, which holds no float objects (on free-threaded
        # Python, a float that one thread made and another replaces goes back to its maker
        # to be freed, a lock and a wake-up on each put).
        self._sums = array.array("d", (0.0, 0.0, now))
        self.puts = 0
        self.gets = 0
        self.fills = 0  # times the channel became full
        self._occupancy = 0.0  # the integral up to the last fold
        # The integral of the fill level as a share of the capacity, up to the last resize:
        # the items held before it count against the capacity they had.
        self._occupancy_shares = 0.0
        self._empty_since: float | None = 0.0  # when it last became empty (None: not empty)
        self._full_since: float | None = None  # when it last became full (None: not full)
        self._empty_time = 0.0
        self._full_time = 0.0

    @property
    def last_put(self) -> float:
        """The ``perf_counter()`` of the latest put (of the channel's making, before any)."""
        return self._sums[_LAST_PUT]

    def put(self, now: float, held: int, k: int, capacity: int) -> bool:
        """``k`` items were put in a channel that held ``held``; whether it is full now."""
        t = now - self._t0
        if held == 0:
            self._end_empty(t)
        sums = self._sums
        sums[_PUT] += k * t
        sums[_LAST_PUT] = now
        self.puts += k
        if held + k < capacity:
            return False
        self._full_since = t
        self.fills += 1
        return True

    def take(self, now: float, held: int, k: int, closed: bool) -> int:
        """``k`` items left a channel that held ``held``; returns the count of gets so far."""
        t = now - self._t0
        self._sums[_GET] += k * t
        self._end_full(t)
        if held == k and not closed:
            self._empty_since = t
        self.gets += k
        return self.gets

    def resized(self, now: float, held: int, old: int, new: int, closed: bool) -> None:
        """The capacity went from ``old`` to ``new`` items."""
        t = now - self._t0
        self._fold(t, held)
        self._occupancy_shares += self._occupancy / old
        self._occupancy = 0.0
        if held < new:
            self._end_full(t)
        elif self._full_since is None and not closed:
            self._full_since = t

    def closed(self, now: float, dropped: int = 0) -> None:
        """The channel was closed (its ``dropped`` items leave now): no longer empty nor full."""
        t = now - self._t0
        self._sums[_GET] += dropped * t
        self._end_empty(t)
        self._end_full(t)

    def snapshot(self, now: float, held: int, capacity: int) -> ChannelStats:
        """The statistics so far of a channel holding ``held`` items of ``capacity``."""
        t = now - self._t0
        life = max(t, 1e-9)
        self._fold(t, held)
        occupancy = self._occupancy_shares + self._occupancy / capacity
        empty, full = self._empty_time, self._full_time
        if self._empty_since is not None:
            empty += t - self._empty_since
        if self._full_since is not None:
            full += t - self._full_since
        return ChannelStats(
            capacity=capacity,
            size=held,
            puts=self.puts,
            gets=self.gets,
            mean_occupancy=min(1.0, max(0.0, occupancy / life)),
            empty_fraction=min(1.0, empty / life),
            full_fraction=min(1.0, full / life),
            life=life,
        )

    def _end_empty(self, t: float) -> None:
        if self._empty_since is not None:
            self._empty_time += t - self._empty_since
            self._empty_since = None

    def _end_full(self, t: float) -> None:
        if self._full_since is not None:
            self._full_time += t - self._full_since
            self._full_since = None

    def _fold(self, t: float, held: int) -> None:
        # Fold the sums into the integral, as if the items held left and came back now:
        # exact, and it keeps both sums from growing for the channel's whole life.
        sums = self._sums
        self._occupancy += sums[_GET] + held * t - sums[_PUT]
        sums[_GET], sums[_PUT] = 0.0, held * t
