"""Items that remember their source: for failure messages, and for resuming.

Every pipeline numbers the items of its source (0, 1, 2, ...) and carries each number, and
the source item itself, with the item through every stage: an item travels as a
:class:`Tagged` record, every op is wrapped to call the user's function on the value alone,
``aggregate`` merges the numbers and source items of a group, and ``disaggregate`` deals them
out again. So a stage that fails on the bytes of a picture names the path or key the item
started from, and the consumer receives the value alone.

A pipeline built with ``resumable=True`` also keeps track of the numbers: when the consumer
receives an item, its numbers are marked done; so is the number of an item a stage failed on
(it was skipped, and an uninterrupted run skips it too). A state is the lowest number not yet
done plus the few done above it (stages that pass items on in completion order deliver out of
order), so it stays small.

Resuming iterates the source again from the start and passes on only the numbers not done:
the source must yield the same items in the same order on each pass (a list, or a sampler
seeded for the epoch). Nothing is replayed but the source itself.
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
    "PassControl",
    "Progress",
    "Tagged",
    "TaggedAsyncGenerator",
    "TaggedAsyncOp",
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

        On free-threaded Python the record is freed by the thread that made it, the next time
        that thread runs Python code, which for an idle pool thread may be long after the
        consumer dropped it: emptied, it holds nothing a memory budget counts meanwhile.
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
    leaves it as it was, for the failure message).
    """

    __slots__ = ("op",)

    def __init__(self, op: Callable[[Any], Any]) -> None:
        self.op = op

    def __call__(self, item: Tagged) -> Tagged:
        item.value = self.op(item.value)
        return item

    def __reduce__(self) -> tuple[Any, ...]:
        return (TaggedOp, (self.op,))


class TaggedAsyncOp:
    """A coroutine op applied to a :class:`Tagged` item's value."""

    __slots__ = ("op",)

    def __init__(self, op: Callable[[Any], Any]) -> None:
        self.op = op

    async def __call__(self, item: Tagged) -> Tagged:
        item.value = await self.op(item.value)
        return item


Account = Callable[[int | tuple[int, ...], int], None]
"""Told ``(tag, change)`` as a one-to-many stage changes how many items carry a source number.

A continuous run counts them (see ``_epochs``): ``+1`` before each output, so that the count
never reaches zero while the input is still at work, and ``-1`` when the input is done (one
that fails is taken away by the failure itself).
"""


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

    def __reduce__(self) -> tuple[Any, ...]:
        return (TaggedGenerator, (self.op,))


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
        # Also guards what its owner keeps with it (a Checkpoint's counts: see _epochs),
        # which then marks with :meth:`mark_held`.
        self.lock = threading.Lock()
        self._below = below
        self._ahead: set[int] = set()  # numbers above ``below`` that are done too
        # What was delivered and failed, apart from the watermark's bookkeeping, to check it
        # (see feedline._ledger): kept under the same lock, no lock of its own.
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
        if isinstance(tag, int):
            self._mark(tag)
            if record is not None:
                record(tag)
        else:
            for number in tag:
                self._mark(number)
                if record is not None:
                    record(number)

    def plan(self, count: int) -> None:
        """The source's pass has ``count`` items in all (it was read to its end)."""
        if self.ledger is not None:
            self.ledger.plan(count)

    def check_end(self) -> None:
        """At the epoch's end: each source item delivered or failed, once (``LedgerError``)."""
        if self.ledger is not None:
            with self.lock:
                self.ledger.check_resume(self._below, self._ahead)
                self.ledger.check_end()

    def _mark(self, number: int) -> None:
        if number != self._below:
            if number > self._below:
                self._ahead.add(number)
            return
        below, ahead = number + 1, self._ahead
        while below in ahead:
            ahead.remove(below)
            below += 1
        self._below = below

    @property
    def below(self) -> int:
        """Every number under this is done."""
        with self.lock:
            return self._below

    def skipper(self) -> Callable[[int], bool]:
        """Whether a source number was done when this was called (for the next pass).

        A snapshot: items delivered during the pass move numbers from ``ahead`` to ``below``
        under the pass's feet, and a number must not look undone while that happens.
        """
        with self.lock:
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


class PassControl:
    """What a continuous run's source tells its source stage (``_pipeline._Passes``).

    A class, not attributes looked up on any source, so that a user's source with methods
    of these names is iterated as any other.
    """

    def boundary(self) -> bool:
        """Whether the item just yielded was the last of its pass."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the source may be read now (it may be too far ahead of its consumer)."""
        raise NotImplementedError

    def wake_with(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` when the source may be read again."""
        raise NotImplementedError


class _TaggedSource:
    """The source's items numbered from 0, without those already done (when resuming)."""

    def __init__(
        self, source: Iterable[Any], progress: Progress | None, stopping: Callable[[], bool]
    ) -> None:
        self._source = source
        self._progress = progress
        self._stopping = stopping
        # A continuous run's _Passes says where passes end, and how far it may be read.
        self.passes = source if isinstance(source, PassControl) else None

    def __iter__(self) -> Iterator[Tagged]:
        iterator = iter(self._source)
        try:
            if self._progress is None:
                yield from map(_first_seen, itertools.count(), iterator)  # no Python loop
                return
            done, stopping = self._progress.skipper(), self._stopping
            skipped = 0
            count = 0
            for number, value in enumerate(iterator):
                count = number + 1
                if not done(number):
                    yield Tagged(number, value, value)
                    continue
                # Skipping a long run of done items happens within one step of the source:
                # a stop must not wait for all of it.
                skipped += 1
                if skipped % RESUME_SKIP_CHECK == 0 and stopping():
                    return
            self._progress.plan(count)
        finally:
            # Closing this wrapper (the run stops, or ends) closes the user's iterator, so
            # that a generator's ``finally`` runs as it does unwrapped.
            close = getattr(iterator, "close", None)
            if close is not None:
                close()


def tag_source(
    source: Iterable[Any], progress: Progress | None, stopping: Callable[[], bool]
) -> Iterable[Tagged]:
    """Number the items of a sync source, skipping those ``progress`` had done (if any).

    ``stopping`` tells a long skip to give up (the run is stopping).
    """
    return _TaggedSource(source, progress, stopping)


class _TaggedAsyncSource:
    def __init__(self, source: AsyncIterable[Any], progress: Progress | None) -> None:
        self._source = source
        self._progress = progress

    async def __aiter__(self) -> AsyncIterator[Tagged]:
        done = self._progress.skipper() if self._progress is not None else None
        iterator = aiter(self._source)
        number = 0
        try:
            async for value in iterator:
                if done is None or not done(number):
                    yield Tagged(number, value, value)
                elif number % RESUME_SKIP_CHECK == 0:
                    await asyncio.sleep(0)  # a stop cancels the source here if not sooner
                number += 1
            if self._progress is not None:
                self._progress.plan(number)
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def tag_async_source(
    source: AsyncIterable[Any], progress: Progress | None
) -> AsyncIterable[Tagged]:
    """Number the items of an async source, skipping those ``progress`` had done (if any)."""
    return _TaggedAsyncSource(source, progress)
