"""How a default-sized queue grows when its size, not its producer, keeps its consumer waiting.

A consumer that finds its queue empty although the queue became full since it last found it
empty was held up by the queue's size: the producer filled every place, stopped, and had to be
woken again, and each such turn costs both sides a sleep and a wake-up (on the event loop, a
task switch; between threads, a thread wake-up). The queue then doubles. A consumer slower than
its producer never finds the queue empty, and a producer slower than its consumer fills it only
with bursts (a ``disaggregate``, a generator), which the room then absorbs. tf.data's autotuned
prefetch buffers grow on the same idea.

A queue after a cheap producer grows (either way) while its consumer is cheap too, or while the
doubled queue holds less than :data:`QUEUE_SPAN` of the consumer's calls; such a queue also
doubles when its producer fills it (``on_fill``): the consumer's own thread runs a cheap
producer whenever it takes an item from a half-empty queue, so it never finds the queue empty,
yet pays a turn of the producer per half a queue.

Growth stops at a number of items and at a byte budget for items as large as those measured
lately (:func:`approx_nbytes`, quick to rise and slow to fall; :data:`UNKNOWN_SIZE_CAP` items if
it cannot tell). A grown queue measures one item in :data:`RECHECK` and shrinks, keeping what it
holds, if items got larger.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._resume import Tagged
from ._settings import MAX_QUIET, RECHECK, SIZE_FALL, UNKNOWN_SIZE_CAP

__all__ = ["Growth", "approx_nbytes"]


_SCALARS = (int, float, complex, bool, type(None))


def approx_nbytes(item: Any, depth: int = 3) -> int | None:
    """Bytes that ``item`` holds in arrays, tensors and buffers, nested up to ``depth`` deep.

    A rough figure for a memory budget: arrays and buffers count their ``nbytes``, strings
    their length, numbers nothing; lists, tuples, dicts and the attributes of plain objects
    (dataclasses) the sum of what they hold, a long one extrapolated from its first 16
    elements. ``None`` if some part cannot be told (an object of another kind, one nested
    deeper, or one whose ``nbytes`` raises, as a sparse torch tensor's does).
    """
    if isinstance(item, _SCALARS):
        return 0
    if isinstance(item, bytes | bytearray | str):
        return len(item)
    try:
        nbytes = getattr(item, "nbytes", None)  # NumPy arrays, torch tensors, memoryviews
    except Exception:
        return None
    if nbytes is not None:
        return nbytes if isinstance(nbytes, int) and nbytes >= 0 else None
    if depth <= 0:
        return None
    if isinstance(item, Tagged):
        return approx_nbytes(item.value, depth)
    if isinstance(item, dict):
        item = list(item.values())
    elif not isinstance(item, list | tuple):
        fields = getattr(item, "__dict__", None)
        if not isinstance(fields, dict) or not fields:
            return None
        item = list(fields.values())
    if not item:
        return 0
    head = item[:16]
    total = 0
    for x in head:
        size = approx_nbytes(x, depth - 1)
        if size is None:
            return None
        total += size
    return total * len(item) // len(head)


class Growth:
    """How one channel grows: its limits, and when it last tried.

    The channel calls :meth:`found_empty` (with its lock held) when its consumer finds it empty,
    and :meth:`found_full` when its producer fills it; it measures the item that follows with
    :meth:`target` if that returns true, and one item in :data:`RECHECK` while grown. A
    doubling that changes nothing (at a limit) makes the channel stop asking for a while, so
    that a channel that cannot grow does not measure an item at every turn: first for
    :data:`RECHECK` items taken, then twice as many each time, up to :data:`MAX_QUIET`.

    Args:
        start: The channel's first capacity; it never shrinks below it.
        grow_to: The most items it grows to.
        grow_bytes: The most bytes of items like the one measured it grows to hold.
        allowed: Whether the channel may now double from the capacity given (``None``:
            always). Between stages: whether its producer is cheap and its consumer cheap or
            the doubled queue would hold less than :data:`QUEUE_SPAN` of its work, since only
            then does a hand-over cost much next to the work it hands over. A grown channel
            that could not now double from a quarter of its size shrinks back to its start
            at its next measure. It may be called with the channel's lock held: it must not
            use the channel.
        on_fill: Whether it also doubles when its producer fills it (while allowed).

    """

    __slots__ = (
        "_allowed",
        "_doubling",
        "_fills_seen",
        "_nbytes",
        "_quiet",
        "_quiet_until",
        "first",
        "grow_bytes",
        "grow_to",
        "on_fill",
        "start",
    )

    recheck = RECHECK  # a grown channel measures one item in this many

    def __init__(
        self,
        start: int,
        grow_to: int,
        grow_bytes: int,
        allowed: Callable[[int], bool] | None = None,
        on_fill: bool = False,
    ) -> None:
        self.start = start  # the size it shrinks back to
        self.first = start  # the size the build gave it
        self.grow_to = grow_to
        self.grow_bytes = grow_bytes
        self._allowed = allowed
        self.on_fill = on_fill
        self._fills_seen = 0  # the channel's fills when a doubling was last asked for
        self._nbytes: float | None = None  # bytes per item it is sized for (None: not known)
        self._doubling = False  # the next item measured decides a doubling
        self._quiet = RECHECK  # items taken without a doubling after one that changed nothing
        self._quiet_until = 0  # the channel's gets before which no doubling is asked for

    def rebase(self, start: int) -> None:
        """Shrink back to ``start`` from now on (the tuner changed a stage).

        Not below the build's size; the byte limit still applies above that (see
        :meth:`target`).
        """
        self.start = max(self.first, min(self.grow_to, start))

    def allowed(self, capacity: int) -> bool:
        """Whether the channel may now double from ``capacity`` items."""
        return self._allowed is None or self._allowed(capacity)

    def found_empty(self, fills: int, gets: int) -> bool:
        """Whether to measure the next item, now that the consumer found the channel empty.

        Yes if the channel became full since the consumer last found it empty, unless a
        recent doubling changed nothing. Called with the channel's lock held.
        """
        if fills == self._fills_seen or gets < self._quiet_until:
            return False
        self._fills_seen = fills
        self._doubling = True
        return True

    def found_full(self, fills: int, gets: int, capacity: int) -> bool:
        """Whether to measure the next item, now that the producer filled the channel.

        Yes for a channel that grows on fills (``on_fill``) while it may double from
        ``capacity``, unless a recent doubling changed nothing. The fill then counts as seen:
        the consumer finding the channel empty after it asks for no second doubling. Called
        with the channel's lock held.
        """
        if not self.on_fill or gets < self._quiet_until or not self.allowed(capacity):
            return False
        self._fills_seen = fills
        self._doubling = True
        return True

    def take_doubling(self) -> bool:
        """Whether the item being measured decides a doubling (channel lock held); clears it."""
        doubling, self._doubling = self._doubling, False
        return doubling

    def target(self, item: Any, capacity: int, doubling: bool) -> int:
        """The capacity to have after measuring ``item`` (called without the channel's lock).

        Doubled within the limits if ``doubling`` (the caller checks :meth:`allowed` first);
        otherwise back within the byte budget for items like those measured lately, or back
        to the start if it could not now double even from a quarter of ``capacity`` (a margin
        of two against noise in the call times that allowed it).
        """
        if doubling:
            return min(self.limit(item), 2 * capacity)
        if capacity <= self.first:
            return capacity  # nothing to shrink: no need to measure
        if not self.allowed(max(1, capacity // 4)):
            return min(self.start, self.limit(item))  # the tuner's size, within the bytes
        return min(capacity, self.limit(item))

    def settled(self, gets: int, grew: bool) -> None:
        """Record how a doubling ended (channel lock held), to back off if it changed nothing."""
        if grew:
            self._quiet = RECHECK
        else:
            self._quiet_until = gets + self._quiet
            self._quiet = min(2 * self._quiet, MAX_QUIET)

    def limit(self, item: Any) -> int:
        """The most items the channel may hold, ``item`` measured (never below its first size).

        Sized for the bytes per item measured lately: they rise at once to a larger item, and
        fall by :data:`SIZE_FALL` of the way toward a smaller one.
        """
        try:
            nbytes = approx_nbytes(item)
        except Exception:  # a user's object may fail in ways approx_nbytes cannot foresee
            nbytes = None
        if nbytes is None:
            limit = UNKNOWN_SIZE_CAP
        else:
            old = self._nbytes
            if old is None or nbytes > old:
                each = float(nbytes)
            else:
                each = old + SIZE_FALL * (nbytes - old)
            self._nbytes = each
            limit = int(self.grow_bytes // each) if each > 0 else self.grow_to
        return max(self.first, min(self.grow_to, limit))
