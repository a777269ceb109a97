"""Resumable pipelines: which source items the consumer has received, and how to skip them.

A pipeline built with ``resumable=True`` numbers the items of its source (0, 1, 2, ...) and
carries each number with the item through every stage: an item travels as a :class:`Tagged`
pair, every op is wrapped to call the user's function on the value alone, and ``aggregate``
merges the numbers of a group. When the consumer receives an item, its numbers are marked
done; so is the number of an item a stage failed on (it was skipped, and an uninterrupted run
skips it too). A state is the lowest number not yet done plus the few done above it (stages
that pass items on in completion order deliver out of order), so it stays small.

Resuming iterates the source again from the start and passes on only the numbers not done:
the source must yield the same items in the same order on each pass (a list, or a sampler
seeded for the epoch). Nothing is replayed but the source itself.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from ._stages._common import sample_repr

__all__ = [
    "STATE_VERSION",
    "Progress",
    "Tagged",
    "TaggedAsyncOp",
    "TaggedOp",
    "merge_group",
    "tag_async_source",
    "tag_source",
]

STATE_VERSION = 1


class Tagged:
    """An item on its way through a resumable pipeline, with the source number(s) it came from.

    ``tag`` is an int for one source item, or a tuple of ints once :func:`merge_group` has
    grouped several.
    """

    __slots__ = ("tag", "value")

    def __init__(self, tag: int | tuple[int, ...], value: Any) -> None:
        self.tag = tag
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (Tagged, (self.tag, self.value))

    def __repr__(self) -> str:
        # What failure messages show: where in the source the sample was, then the sample
        # (first, as messages cut a long repr at its end).
        if isinstance(self.tag, int):
            where = f"source item {self.tag}"
        else:
            shown = ", ".join(map(str, self.tag[:4])) + (", ..." if len(self.tag) > 4 else "")
            where = f"source items {shown}"
        return f"[{where}] {sample_repr(self.value)}"


class TaggedOp:
    """A sync op applied to a :class:`Tagged` item's value; pickles when the op does."""

    __slots__ = ("op",)

    def __init__(self, op: Callable[[Any], Any]) -> None:
        self.op = op

    def __call__(self, item: Tagged) -> Tagged:
        return Tagged(item.tag, self.op(item.value))

    def __reduce__(self) -> tuple[Any, ...]:
        return (TaggedOp, (self.op,))


class TaggedAsyncOp:
    """A coroutine op applied to a :class:`Tagged` item's value."""

    __slots__ = ("op",)

    def __init__(self, op: Callable[[Any], Any]) -> None:
        self.op = op

    async def __call__(self, item: Tagged) -> Tagged:
        return Tagged(item.tag, await self.op(item.value))


def merge_group(group: list[Tagged]) -> Tagged:
    """What ``aggregate`` emits in a resumable pipeline: the values, under all their numbers."""
    tags: list[int] = []
    values = []
    for item in group:
        tag = item.tag
        if isinstance(tag, int):
            tags.append(tag)
        else:
            tags.extend(tag)
        values.append(item.value)
    return Tagged(tuple(tags), values)


class Progress:
    """The source numbers done in the current epoch; thread-safe.

    Args:
        below: Every number below this is done (more are marked with :meth:`mark`).

    """

    def __init__(self, below: int = 0) -> None:
        self._lock = threading.Lock()
        self._below = below
        self._ahead: set[int] = set()  # numbers above ``below`` that are done too

    def mark(self, tag: int | tuple[int, ...]) -> None:
        """Record that the item(s) numbered ``tag`` were delivered (or failed)."""
        with self._lock:
            if isinstance(tag, int):
                self._mark(tag)
            else:
                for number in tag:
                    self._mark(number)

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

    def skipper(self) -> Callable[[int], bool]:
        """Whether a source number was done when this was called (for the next pass).

        A snapshot: items delivered during the pass move numbers from ``ahead`` to ``below``
        under the pass's feet, and a number must not look undone while that happens.
        """
        with self._lock:
            below, ahead = self._below, frozenset(self._ahead)
        return lambda number: number < below or number in ahead

    def state(self) -> dict[str, Any]:
        """A copy of the position, as :meth:`Pipeline.state_dict` returns it."""
        with self._lock:
            return {
                "version": STATE_VERSION,
                "done_below": self._below,
                "done_ahead": sorted(self._ahead),
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
        for number in ahead:
            progress.mark(number)  # numbers at or below the watermark move it on, or are done
        return progress


_SKIP_CHECK = 256  # skipped items between two looks at whether the run is stopping


class _TaggedSource:
    """The source's items numbered from 0, without those already done."""

    def __init__(
        self, source: Iterable[Any], progress: Progress, stopping: Callable[[], bool]
    ) -> None:
        self._source = source
        self._progress = progress
        self._stopping = stopping

    def __iter__(self) -> Iterator[Tagged]:
        done, stopping = self._progress.skipper(), self._stopping
        iterator = iter(self._source)
        skipped = 0
        try:
            for number, value in enumerate(iterator):
                if not done(number):
                    yield Tagged(number, value)
                    continue
                # Skipping a long run of done items happens within one step of the source:
                # a stop must not wait for all of it.
                skipped += 1
                if skipped % _SKIP_CHECK == 0 and stopping():
                    return
        finally:
            # Closing this wrapper (the run stops, or ends) closes the user's iterator, so
            # that a generator's ``finally`` runs as it does without resumable=True.
            close = getattr(iterator, "close", None)
            if close is not None:
                close()


def tag_source(
    source: Iterable[Any], progress: Progress, stopping: Callable[[], bool]
) -> Iterable[Tagged]:
    """Number the items of a sync source, skipping those ``progress`` had done.

    ``stopping`` tells a long skip to give up (the run is stopping).
    """
    return _TaggedSource(source, progress, stopping)


class _TaggedAsyncSource:
    def __init__(self, source: AsyncIterable[Any], progress: Progress) -> None:
        self._source = source
        self._progress = progress

    async def __aiter__(self) -> AsyncIterator[Tagged]:
        done = self._progress.skipper()
        iterator = aiter(self._source)
        number = 0
        try:
            async for value in iterator:
                if not done(number):
                    yield Tagged(number, value)
                elif number % _SKIP_CHECK == 0:
                    await asyncio.sleep(0)  # a stop cancels the source here if not sooner
                number += 1
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def tag_async_source(source: AsyncIterable[Any], progress: Progress) -> AsyncIterable[Tagged]:
    """Number the items of an async source, skipping those ``progress`` had done."""
    return _TaggedAsyncSource(source, progress)
