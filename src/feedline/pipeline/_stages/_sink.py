"""The consumer's end of a pipeline: a blocking ``get`` for the user's thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from .._defs import SINK_GROW_BYTES
from .._queue import EMPTY, Channel
from .._resume import Tagged

__all__ = ["SinkReader"]

_SPIN = 100e-6
"""Seconds the consumer yields (``sleep(0)`` releases the GIL) before it sleeps on the signal.
Waking a sleeping thread costs 50-400 us on virtual machines; a producer that is mid-burst
delivers the next item well within this time, so a short spin saves a sleep and a wake. The
consumer spins only while items have recently arrived within that time after it began to wait:
when they take longer, spinning would only take CPU from the stages. And it spins only behind an
event-loop stage: a cheap threaded chain it runs itself, and behind an expensive one the cores
are busy with the stage's threads, whose CPU a spin would take (measured in one 5-round
comparison: SHA-256 on 4 threads over 2 cores, 0.89x ``ThreadPoolExecutor.map`` with the spin
and 0.94x without)."""


_UNKNOWN_SIZE_CAP = 16
"""The most a growing sink holds of items whose size :func:`approx_nbytes` cannot tell."""

_RECHECK = 64
"""A grown sink measures one item in this many against its byte budget, and shrinks if over."""

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


class SinkReader:
    """Reads the last channel from the consumer's thread.

    The consumer sleeps on a plain lock used as a one-slot signal (cheaper than a condition
    variable): it raises ``_waiting`` and re-checks the channel before it sleeps, and a
    producer that sees ``_waiting`` releases the lock. A spare release only causes one extra
    check of the channel.

    With ``grow_to`` above the channel's capacity, the reader doubles the capacity each time
    it has to wait on an empty channel that became full since its last wait: the producer
    was stopped by the buffer's size, not by its own speed, and every such turn costs the
    consumer and the producer a sleep and a wake. A consumer slower than the pipeline never
    waits, and a pipeline slower than its consumer fills the channel only with bursts (a
    ``disaggregate``, a generator), which the room then absorbs. This is how tf.data's
    autotuned prefetch buffers grow. The capacity stays within ``grow_to`` items and within
    ``grow_bytes`` of items like the one measured (:func:`approx_nbytes`; at most
    :data:`_UNKNOWN_SIZE_CAP` items if it cannot tell), measured on the item that a growth
    follows and on one item in :data:`_RECHECK` while grown: if items got larger, the
    channel shrinks (keeping what it holds) back within the budget.
    """

    def __init__(
        self,
        channel: Channel,
        pull: Callable[[], bool],
        before_sleep: Callable[[], None],
        spin: bool,
        runs_chain: Callable[[], bool] | None = None,
        grow_to: int = 0,
        grow_bytes: int = SINK_GROW_BYTES,
    ) -> None:
        self._channel = channel
        self._start = channel.capacity
        self._grow_to = grow_to if grow_to > channel.capacity else 0  # 0: grows no more
        self._grow_bytes = grow_bytes
        self._fills_seen = 0  # channel.fills when the consumer last began to wait
        self._grow_next = False  # measure the next item and grow the channel
        self._gets = 0  # items taken while grown (above the start): one in _RECHECK is measured
        self._spin = spin  # whether to yield a while before sleeping (see _SPIN)
        self._pull = pull  # runs a cheap upstream job here rather than sleeping
        self._before_sleep = before_sleep  # makes sure some job will produce what we wait for
        # Whether a waiting consumer would run the whole chain (every stage cheap and
        # threaded): asked once per wait, so that pool jobs need not check on every item.
        self._runs_chain = runs_chain
        self.hungry = False  # waiting, and runs_chain said yes: cheap pool jobs step aside
        self._signal = threading.Lock()
        self._signal.acquire()
        self._waiting = False
        self._interrupted = False
        self._delay = 0.0  # smoothed wait for an item, measured to its arrival (the put)

    def _wake(self) -> None:
        if self._waiting:
            self._waiting = False
            with contextlib.suppress(RuntimeError):  # another producer released it already
                self._signal.release()

    def on_data(self) -> None:
        """An item arrived or the channel closed: wake the consumer if it sleeps."""
        if self._waiting:
            self._wake()

    def on_space(self) -> None:
        """Unused: the consumer never puts."""

    def interrupt(self) -> None:
        """Wake the consumer so that it notices the run has failed or stopped."""
        self._interrupted = True
        self._waiting = True
        self._wake()

    def _chain_runs_here(self) -> bool:
        # Whether this consumer, waiting, would run the whole (cheap, threaded) chain itself.
        return self._runs_chain is not None and self._runs_chain()

    def get(self, timeout: float | None) -> Any:
        """Take the next item.

        Returns:
            The item, or :data:`EMPTY` if the channel is exhausted or the reader was
            interrupted (the caller tells which apart).

        Raises:
            TimeoutError: If nothing arrived within ``timeout`` seconds.

        """
        channel = self._channel
        # Read before the channel is found empty, so that a fill after that counts for the
        # next wait, not this one; and without the channel's lock: a count that is one put
        # stale only delays growth to the next wait.
        fills = channel.fills
        item = channel.try_get()
        if item is not EMPTY or channel.exhausted or self._interrupted:
            if item is not EMPTY and channel.capacity > self._start:
                self._gets += 1
                if not self._gets % _RECHECK:
                    self._fit(item)
            return item
        if self._grow_to and fills != self._fills_seen:
            self._fills_seen = fills
            self._grow_next = True
        self.hungry = self._chain_runs_here()
        try:
            item = self._wait(timeout)
        finally:
            self.hungry = False
        if self._grow_next and item is not EMPTY:
            self._grow(item)
        return item

    def _limit(self, item: Any) -> int:
        # The most items like this one that the budget allows (never below the start).
        try:
            nbytes = approx_nbytes(item)
        except Exception:  # a user's object may fail in ways approx_nbytes cannot foresee
            nbytes = None
        if nbytes is None:
            limit = _UNKNOWN_SIZE_CAP
        elif nbytes > 0:
            limit = self._grow_bytes // nbytes
        else:
            limit = self._grow_to or self._channel.capacity
        return max(self._start, limit)

    def _grow(self, item: Any) -> None:
        # Double the channel, within the item and byte limits; stop trying once at a limit.
        self._grow_next = False
        size = self._channel.capacity
        limit = min(self._grow_to, self._limit(item))
        if limit <= size:
            self._grow_to = 0
            return
        self._channel.resize(min(limit, 2 * size))

    def _fit(self, item: Any) -> None:
        # Shrink a grown channel whose items got larger than those it grew for.
        limit = self._limit(item)
        if limit < self._channel.capacity:
            self._channel.resize(limit)

    def _wait(self, timeout: float | None) -> Any:
        channel = self._channel
        deadline = None if timeout is None else time.monotonic() + timeout
        started = time.perf_counter()
        spin_until = started + _SPIN if self._spin and self._delay < _SPIN else 0.0
        while True:
            item = channel.try_get()
            if item is not EMPTY or channel.exhausted or self._interrupted:
                if item is not EMPTY:
                    delay = max(0.0, channel.last_put - started)
                    self._delay += 0.25 * (delay - self._delay)
                return item
            pulled = self._pull()  # moved items (here or upstream)?
            late = deadline is not None and time.monotonic() >= deadline
            if late and not len(channel) and not channel.closed:
                raise TimeoutError(f"no item arrived from the pipeline within {timeout} s")
            if pulled:
                continue
            if self.hungry:
                # The pull found nothing to run: a stage may have turned expensive since the
                # wait began, and then jobs must stop stepping aside for us (they would leave
                # its items to a pull that no longer runs it, over and over).
                self.hungry = self._chain_runs_here()
            if spin_until and time.perf_counter() < spin_until:
                time.sleep(0)
                continue
            self._waiting = True
            if len(channel) or channel.closed or self._interrupted:
                self._waiting = False
                continue
            self._before_sleep()
            if deadline is None:
                woken = self._signal.acquire()
            else:
                remaining = deadline - time.monotonic()
                woken = remaining > 0 and self._signal.acquire(timeout=remaining)
            # Woken, timed out, or the lock held a spare release and returned at once: lower
            # the flag in every case, or every later put would release the lock for nothing.
            self._waiting = False
            if not woken and not len(channel) and not channel.closed:
                raise TimeoutError(f"no item arrived from the pipeline within {timeout} s")
