"""How a default-sized queue grows when its size, not its producer, keeps its consumer waiting.

A consumer that finds its queue empty although it became full since it last found it empty was
held up by the queue's size (each turn costs both sides a wake-up): the queue doubles, as
tf.data's prefetch buffers grow. A queue between stages also doubles when its cheap producer
fills it, before its consumer runs dry. Growth stops at a number of items and at a byte budget
for items like those measured lately (see "Queue sizes and growth" in the README); a grown
queue measures one item in :data:`RECHECK` and shrinks if they grew.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._resume import Tagged
from ._settings import MAX_QUIET, NUMBER_BYTES, RECHECK, SIZE_FALL, UNKNOWN_SIZE_CAP

__all__ = ["Growth", "approx_nbytes"]


_NUMBERS = (int, float, complex)


def approx_nbytes(item: Any, depth: int = 3) -> int | None:
    """Bytes that ``item`` holds in arrays, tensors and buffers, nested up to ``depth`` deep.

    A rough figure for a memory budget: arrays and buffers count their ``nbytes``, strings
    their length, numbers :data:`NUMBER_BYTES` (``None`` and booleans nothing, one object
    each); lists, tuples, dicts and the attributes of plain objects
    (dataclasses) the sum of what they hold, a long one extrapolated from its first 16
    elements. ``None`` if some part cannot be told (an object of another kind, one nested
    deeper, or one whose ``nbytes`` raises, as a sparse torch tensor's does).
    """
    if item is None or isinstance(item, bool):
        return 0
    if isinstance(item, _NUMBERS):
        return NUMBER_BYTES
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

    The channel calls :meth:`found_empty` and :meth:`found_full` (with its lock held); if they
    return true it measures the next item taken with :meth:`target`, as it does one item in
    :data:`RECHECK` while grown. A doubling that changes nothing (at a limit) stops the asking
    for :data:`RECHECK` items taken, then twice as many each time, up to :data:`MAX_QUIET`.

    Args:
        start: The channel's first capacity; it never shrinks below it.
        grow_to: The most items it grows to.
        grow_bytes: The most bytes of items like the one measured it grows to hold.
        allowed: Whether the channel may now double from the capacity given (``None``:
            always); called with the channel's lock held, so it must not use the channel. A
            grown channel that could not double from a quarter of its size shrinks back.
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
        """Shrink back to ``start`` (not below the build's size) from now on: the tuner's."""
        self.start = max(self.first, min(self.grow_to, start))

    def allowed(self, capacity: int) -> bool:
        """Whether the channel may now double from ``capacity`` items."""
        return self._allowed is None or self._allowed(capacity)

    def found_empty(self, fills: int, gets: int) -> bool:
        """Whether to measure the next item: the consumer found the channel empty after a fill.

        Not while a recent doubling that changed nothing holds the asking back.
        """
        if fills == self._fills_seen or gets < self._quiet_until:
            return False
        self._fills_seen = fills
        self._doubling = True
        return True

    def found_full(self, fills: int, gets: int, capacity: int) -> bool:
        """Whether to measure the next item: the producer filled a channel that grows ``on_fill``.

        The fill then counts as seen, so the consumer finding it empty asks for no second one.
        """
        if not self.on_fill or gets < self._quiet_until or not self.allowed(capacity):
            return False
        self._fills_seen = fills
        self._doubling = True
        return True

    def take_doubling(self) -> bool:
        """Whether the item being measured decides a doubling; clears it."""
        doubling, self._doubling = self._doubling, False
        return doubling

    def target(self, item: Any, capacity: int, doubling: bool) -> int:
        """The capacity to have after measuring ``item`` (called without the channel's lock).

        Doubled within the limits if ``doubling`` (the caller checks :meth:`allowed` first);
        otherwise within the byte budget, or back to the start if it could not double even
        from a quarter of ``capacity`` (a margin against noise in the call times).
        """
        if doubling:
            return min(self.limit(item), 2 * capacity)
        if capacity <= self.first:
            return capacity  # nothing to shrink: no need to measure
        if not self.allowed(max(1, capacity // 4)):
            return min(self.start, self.limit(item))  # the tuner's size, within the bytes
        return min(capacity, self.limit(item))

    def settled(self, gets: int, grew: bool) -> None:
        """Record how a doubling ended, to back off if it changed nothing."""
        if grew:
            self._quiet = RECHECK
        else:
            self._quiet_until = gets + self._quiet
            self._quiet = min(2 * self._quiet, MAX_QUIET)

    def within_bytes(self, capacity: int) -> int:
        """``capacity`` within the item limit and the byte budget, not below the build's size.

        The budget holds so many of the items measured lately; while none was, it cuts
        nothing (a channel resized up measures its next item, see ``Channel.resize``).
        """
        each = self._nbytes
        if each:
            capacity = min(capacity, int(self.grow_bytes // each))
        return max(self.first, min(self.grow_to, capacity))

    def limit(self, item: Any) -> int:
        """The most items the channel may hold, ``item`` measured (never below its first size).

        The bytes per item it is sized for rise at once, and fall by :data:`SIZE_FALL`.
        """
        try:
            nbytes = approx_nbytes(item)
        except Exception:  # a user's object may fail in ways approx_nbytes cannot foresee
            nbytes = None
        if nbytes is None:
            return max(self.first, min(self.grow_to, UNKNOWN_SIZE_CAP))
        old = self._nbytes
        self._nbytes = (
            float(nbytes) if old is None or nbytes > old else old + SIZE_FALL * (nbytes - old)
        )
        return self.within_bytes(self.grow_to)
