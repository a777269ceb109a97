"""Items that remember their source (for failure messages), and resuming (``resumable=True``).

See "Source items, and resuming" in the README. Items travel as :class:`Tagged` records
numbered by their source item; ops are wrapped to work on the value; :class:`Progress` keeps
the numbers the consumer received (or a stage skipped) so that a resumed pass skips them.
"""

from __future__ import annotations

import asyncio
import itertools
import reprlib
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from feedline._ledger import Ledger, ledger_check

from ._settings import RESUME_SKIP_CHECK

__all__ = [
    "STATE_VERSION",
    "Account",
    "Progress",
    "Tagged",
    "TaggedAsyncGenerator",
    "TaggedGenerator",
    "TaggedOp",
    "merge_group",
    "sample_repr",
    "split_group",
    "tag_async_source",
    "tag_source",
]

STATE_VERSION = 1

_repr = reprlib.Repr()
_repr.maxstring = 80
_repr.maxother = 80
_repr.maxlist = 6
_repr.maxdict = 6


def sample_repr(item: Any) -> str:
    """A short, safe ``repr`` of an item, for error messages."""
    try:
        return _repr.repr(item)
    except Exception:  # a broken __repr__ must not hide the real error
        return f"<{type(item).__name__} object>"


class Tagged:
    """An item on its way through a pipeline, with the source item(s) it came from.

    ``tag`` is the source number, an int for one source item, or a tuple of ints once
    :func:`merge_group` has grouped several; ``origin`` is the source item itself (or a tuple
    of them, in the same order).
    """

    __slots__ = ("origin", "tag", "value")

    def __init__(self, tag: int | tuple[int, ...], value: Any, origin: Any = None) -> None:
        self.tag = tag
        self.value = value
        self.origin = origin

    def __reduce__(self) -> tuple[Any, ...]:
        return (Tagged, (self.tag, self.value, self.origin))

    def take(self) -> Any:
        """The value, for the consumer; the record lets go of it and of the source item.

        On free-threaded Python the thread that made the record frees it, maybe much later.
        """
        value = self.value
        self.value = self.origin = None
        return value

    def source(self) -> str:
        """Which source item(s) this came from, for messages.

        The number(s), and the source item(s) themselves where the stages changed the value.
        """
        if isinstance(self.tag, int):
            if self.value is self.origin:  # untouched: the sample says what it is
                return f"source item {self.tag}"
            return f"source item {self.tag}: {sample_repr(self.origin)}"
        pairs = list(zip(self.tag, self.origin or (), strict=False))[:3]
        shown = ", ".join(f"{n} ({sample_repr(o)})" for n, o in pairs)
        return f"source items {shown}" + (", ..." if len(self.tag) > 3 else "")

    def __repr__(self) -> str:
        return f"{sample_repr(self.value)} ({self.source()})"


def _first_seen(number: int, value: Any) -> Tagged:
    return Tagged(number, value, value)


class TaggedOp:
    """A sync op applied to a :class:`Tagged` item's value; pickles when the op does.

    The record is updated in place (one item has one holder at a time, and an op that raises
    leaves it as it was, for the failure message). Coroutine ops need no wrapper: their
    stage calls them on the value.
    """

    __slots__ = ("op",)

    def __init__(self, op: Callable[[Any], Any]) -> None:
        self.op = op

    def __call__(self, item: Tagged) -> Tagged:
        item.value = self.op(item.value)
        return item


Account = Callable[[int | tuple[int, ...], int], None]
"""Told ``(tag, change)`` as a one-to-many stage changes how many items carry a source number
(a continuous run's checkpoints): ``+1`` before each output, ``-1`` once the input is done."""


class TaggedGenerator:
    """A generator op applied to a :class:`Tagged` item's value: each output keeps its source.

    With ``account``, the outputs are counted as they go (see :data:`Account`).
    """

    __slots__ = ("account", "op")

    def __init__(self, op: Callable[[Any], Iterable[Any]], account: Account | None = None) -> None:
        self.op = op
        self.account = account

    def __call__(self, item: Tagged) -> Iterator[Tagged]:
        tag, origin, account = item.tag, item.origin, self.account
        if account is None:
            for value in self.op(item.value):
                yield Tagged(tag, value, origin)
        else:
            yield from _counted(tag, origin, self.op(item.value), account)


class TaggedAsyncGenerator:
    """An async generator op applied to a :class:`Tagged` item's value."""

    __slots__ = ("account", "op")

    def __init__(
        self, op: Callable[[Any], AsyncIterable[Any]], account: Account | None = None
    ) -> None:
        self.op = op
        self.account = account

    async def __call__(self, item: Tagged) -> AsyncIterator[Tagged]:
        tag, origin, account = item.tag, item.origin, self.account
        async for value in self.op(item.value):
            if account is not None:
                account(tag, 1)
            yield Tagged(tag, value, origin)
        if account is not None:
            account(tag, -1)


def merge_group(group: list[Tagged]) -> Tagged:
    """What ``aggregate`` emits: the values, under all their numbers and source items."""
    tags: list[int] = []
    origins: list[Any] = []
    values = []
    for item in group:
        tag = item.tag
        if isinstance(tag, int):
            tags.append(tag)
            origins.append(item.origin)
        else:
            tags.extend(tag)
            origins.extend(item.origin)
        values.append(item.value)
    return Tagged(tuple(tags), values, tuple(origins))


def split_group(item: Tagged, account: Account | None = None) -> Iterator[Tagged]:
    """What ``disaggregate`` passes on: each element, with its own source where it is known.

    The elements of a group that :func:`merge_group` made keep their numbers and source
    items; the elements of any other iterable (a list an op made of one item) share the
    item's, and are counted with ``account`` as a generator's outputs are.
    """
    tag, origin = item.tag, item.origin
    values: Iterable[Any] = item.value
    if isinstance(tag, tuple):
        values = values if isinstance(values, list) else list(values)
        if len(values) == len(tag):
            for number, source, value in zip(tag, origin, values, strict=True):
                yield Tagged(number, value, source)
            return
    if account is None:
        for value in values:
            yield Tagged(tag, value, origin)
    else:
        yield from _counted(tag, origin, values, account)


def _counted(
    tag: int | tuple[int, ...], origin: Any, values: Iterable[Any], account: Account
) -> Iterator[Tagged]:
    # One input's outputs, counted as they go (see Account).
    for value in values:
        account(tag, 1)
        yield Tagged(tag, value, origin)
    account(tag, -1)


class Progress:
    """The source numbers done in the current epoch; thread-safe.

    Args:
        below: Every number below this is done (more are marked with :meth:`mark`).

    """

    def __init__(self, below: int = 0) -> None:
        # Also guards what its owner keeps with it (a Checkpoint's counts, see _epochs),
        # which then marks with :meth:`mark_held`.
        self.lock = threading.Lock()
        self._below = below
        self._ahead: set[int] = set()  # numbers above ``below`` that are done too
        # What was delivered and failed, to check the watermark (see feedline._ledger):
        # under the same lock.
        self.ledger: Ledger | None = (
            Ledger("a resumable pipeline's epoch", unit="source item") if ledger_check() else None
        )

    def mark(self, tag: int | tuple[int, ...], failed: bool = False) -> None:
        """Record that the item(s) numbered ``tag`` were delivered (or ``failed``)."""
        with self.lock:
            self.mark_held(tag, failed)

    def mark_held(self, tag: int | tuple[int, ...], failed: bool = False) -> None:
        """:meth:`mark`, called with :attr:`lock` held."""
        ledger = self.ledger
        record = None if ledger is None else ledger.fail if failed else ledger.deliver
        for number in (tag,) if isinstance(tag, int) else tag:
            if number == self._below:
                below, ahead = number + 1, self._ahead
                while below in ahead:
                    ahead.remove(below)
                    below += 1
                self._below = below
            elif number > self._below:
                self._ahead.add(number)
            if record is not None:
                record(number)

    def plan(self, count: int) -> None:
        """The source's pass has ``count`` items in all (it was read to its end)."""
        if self.ledger is not None:
            self.ledger.plan(count)

    def check_end(self) -> None:
        """At the epoch's end: each source item delivered or failed, once (``LedgerError``).

        Unlocked: the consumer calls it once the epoch ended, and every mark came before the
        stages closed their outputs, which it saw under the channels' locks.
        """
        if self.ledger is not None:
            self.ledger.check_resume(self._below, self._ahead)
            self.ledger.check_end()

    @property
    def below(self) -> int:
        """Every number under this is done.

        Unlocked: it only grows, so a stale value is one read a moment earlier (a
        checkpoint's consumer looks again within ``SOURCE_POLL``; an aggregate at its next
        item or at its end, as it would had the mark come a moment later).
        """
        return self._below

    def skipper(self) -> Callable[[int], bool]:
        """Whether a source number was done when this was called (for the next pass).

        A snapshot, since items delivered during the pass move numbers from ``ahead`` to
        ``below``. Unlocked: called as the pass begins, before any of its items can be marked.
        """
        below, ahead = self._below, frozenset(self._ahead)
        return lambda number: number < below or number in ahead

    def state(self) -> dict[str, Any]:
        """A copy of the position, as :meth:`Pipeline.state_dict` returns it."""
        with self.lock:
            return {
                "version": STATE_VERSION,
                "done_below": self._below,
                "done_ahead": sorted(self._ahead),
                "ledger": None if self.ledger is None else self.ledger.state_dict(),
            }

    @classmethod
    def from_state(cls, state: Any) -> Progress:
        """Check a state from :meth:`state` and make its progress.

        Raises:
            ValueError: If ``state`` is not such a state, saying what was expected.

        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(
                "not a feedline pipeline state: expected the dict that Pipeline.state_dict() "
                f"returns (version {STATE_VERSION}), got {sample_repr(state)}"
            )
        below, ahead = state.get("done_below"), state.get("done_ahead")
        if (
            isinstance(below, bool)
            or not isinstance(below, int)
            or below < 0
            or not isinstance(ahead, (list, tuple))
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in ahead)
        ):
            raise ValueError(
                "a damaged pipeline state: 'done_below' must be an int >= 0 and 'done_ahead' "
                f"a list of ints, got {below!r} and {sample_repr(ahead)}"
            )
        progress = cls(below)
        ledger, progress.ledger = progress.ledger, None
        for number in ahead:
            progress.mark(number)  # numbers at or below the watermark move it on, or are done
        saved = state.get("ledger")
        if ledger is not None and saved is not None:
            # The saved epoch's record: its watermark must pass over what it delivered.
            ledger.load_state_dict(saved)
            ledger.check_resume(below, ahead)
            progress.ledger = ledger
        return progress


def tag_source(
    source: Iterable[Any], progress: Progress | None, stopping: Callable[[], bool]
) -> Iterator[Tagged]:
    """The items of a sync source numbered from 0, without those ``progress`` had done.

    A source that may wait long for its next item offers ``iter_until(stopping)``, which ends
    once the run stops; a long skip gives up then too. Closing this closes the source's
    iterator, so that a generator's ``finally`` runs as it does unwrapped.
    """
    until = getattr(source, "iter_until", None)
    iterator = until(stopping) if callable(until) else iter(source)
    try:
        if progress is None:
            yield from map(_first_seen, itertools.count(), iterator)  # no Python loop
            return
        done, skipped, count = progress.skipper(), 0, 0
        for number, value in enumerate(iterator):
            count = number + 1
            if not done(number):
                yield Tagged(number, value, value)
                continue
            # A long run of done items is skipped within one step of the source: a stop
            # must not wait for all of it.
            skipped += 1
            if skipped % RESUME_SKIP_CHECK == 0 and stopping():
                return
        progress.plan(count)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


async def tag_async_source(
    source: AsyncIterable[Any], progress: Progress | None
) -> AsyncIterator[Tagged]:
    """Number the items of an async source, skipping those ``progress`` had done (if any)."""
    done = progress.skipper() if progress is not None else None
    iterator = aiter(source)
    number = 0
    try:
        async for value in iterator:
            if done is None or not done(number):
                yield Tagged(number, value, value)
            elif number % RESUME_SKIP_CHECK == 0:
                await asyncio.sleep(0)  # a stop cancels the source here if not sooner
            number += 1
        if progress is not None:
            progress.plan(number)
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
