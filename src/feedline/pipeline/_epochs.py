"""Continuous runs (``build(continuous=True)``): the passes, and where each epoch ends.

See "Continuous runs" in the README: :class:`Passes` is the run's source, and an epoch is over
at a *checkpoint* (the consumer, or an ``aggregate``) when every item that carries one of its
numbers has reached it or failed before it (one-to-many stages and failures change the count
through ``_resume.Account``).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._defs import AggregateConfig, DisaggregateConfig, StageConfig
from ._gated import GatedSource
from ._resume import Account, Progress, Tagged, split_group

__all__ = ["Accounting", "Checkpoint", "Passes"]


class Passes(GatedSource):
    """A continuous run's source: its items numbered across passes over the user's source.

    Each pass calls ``set_epoch`` (where the source has one) and records where it ended, before
    its last item goes on (the source is read one item ahead); an empty pass ends the run.

    No lock: the pass ends only grow, each appended by the source's thread before it puts the
    items after it (a channel's lock orders them for the taker); the consumer's epoch only
    grows, and the consumer wakes the source stage after it moves it, under that stage's lock.
    """

    def __init__(self, source: Any, first_epoch: int, ahead: int) -> None:
        self._source = source
        self._first = first_epoch
        self._ends: list[int] = []  # after pass k, this many items were numbered in all
        self._last = False  # the item just yielded ended its pass
        self._count = 0  # items read from the source so far
        self._ahead = ahead
        self._consumer = first_epoch  # the epoch the consumer's loop is in, or runs next
        self._wake: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[Tagged]:
        count = 0
        end = object()
        for epoch in itertools.count(self._first):
            setter = getattr(self._source, "set_epoch", None)
            if callable(setter):
                setter(epoch)
            before = count
            items = iter(self._source)
            item = next(items, end)
            while item is not end:
                following = next(items, end)
                count += 1
                self._count = count + (following is not end)
                if following is end:
                    self._ends.append(count)
                    self._last = True
                yield Tagged(count - 1, item, item)
                self._last = False
                item = following
            if count == before:
                self._ends.append(count)
                return

    def boundary(self) -> bool:
        """Whether the item just yielded was the last of its pass (for the source stage)."""
        return self._last

    def ready(self) -> bool:
        """Whether the source may be read: at most ``ahead`` items past the consumer's epoch."""
        k = self._consumer - self._first
        return k >= len(self._ends) or self._count < self._ends[k] + self._ahead

    def wake_with(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` when the source may be read again (the source stage's kick)."""
        self._wake = wake

    def consumer_at(self, epoch: int) -> None:
        """The consumer's loop is in ``epoch`` (or runs it next): reads may go further."""
        self._consumer = epoch
        if self._wake is not None:
            self._wake()

    def epoch_of(self, number: int) -> int:
        """The epoch of the item numbered ``number``."""
        return self._first + bisect.bisect_right(self._ends, number)

    def complete(self, epoch: int, below: int) -> bool:
        """Whether every item of ``epoch`` is done, when every number under ``below`` is."""
        k = epoch - self._first
        return k < len(self._ends) and below >= self._ends[k]


class Checkpoint:
    """The items on their way to one point of a continuous run, per source number."""

    def __init__(self, passes: Passes) -> None:
        self._passes = passes
        self.after: Account | None = None  # an aggregate's: the points after it
        # An aggregate's: called when an epoch may have ended here from another stage's
        # thread (items filtered out before it), to close the epoch's partial group.
        self.on_complete: Callable[[], None] | None = None
        self._done = Progress()  # the numbers with no item left on the way
        self._left: dict[int, int] = {}  # counts other than one, under ``_done``'s lock

    def change(self, tag: int | tuple[int, ...], change: int) -> None:
        """Add ``change`` to the items on their way for each number of ``tag``."""
        done = self._done
        marked = None
        with done.lock:
            for number in (tag,) if isinstance(tag, int) else tag:
                left = self._left.get(number, 1) + change
                if left:
                    self._left[number] = left
                else:
                    self._left.pop(number, None)
                    done.mark_held(number)
                    marked = number
        hook = self.on_complete
        if marked is not None and hook is not None and self.complete(self.epoch_of(marked)):
            hook()

    def arrived(self, tag: int | tuple[int, ...]) -> None:
        """An item carrying ``tag`` reached this point (or failed before it)."""
        self.change(tag, -1)

    def dropped(self, tag: int | tuple[int, ...]) -> None:
        """An aggregate dropped an item carrying ``tag`` (``drop_last``): it goes no further."""
        if self.after is not None:
            self.after(tag, -1)

    def epoch_of(self, tag: int | tuple[int, ...]) -> int:
        """The epoch an item belongs to: its first number's."""
        return self._passes.epoch_of(tag if isinstance(tag, int) else tag[0])

    def complete(self, epoch: int) -> bool:
        """Whether every item of ``epoch`` has reached this point (its pass has ended)."""
        return self._passes.complete(epoch, self._done.below)


class Accounting:
    """The checkpoints of one continuous run (each ``aggregate``'s, then the consumer's)."""

    def __init__(self, passes: Passes, stages: Sequence[StageConfig]) -> None:
        self.passes = passes
        self._points = [
            (index, Checkpoint(passes))
            for index, stage in enumerate(stages)
            if isinstance(stage, AggregateConfig)
        ]
        self.consumer = Checkpoint(passes)
        self._points.append((len(stages), self.consumer))
        self._index = {stage.name: index for index, stage in enumerate(stages)}

    def account(self, index: int) -> Account:
        """What the stage at ``stages[index]`` tells of its items: the points after it."""
        after = [point for at, point in self._points if at > index]

        def change(tag: int | tuple[int, ...], change: int) -> None:
            for point in after:
                point.change(tag, change)

        return change

    def failed(self, item: Tagged, stage: str) -> None:
        """The stage named ``stage`` skipped ``item``: it reaches none of the points after."""
        self.account(self._index[stage])(item.tag, -1)

    def counted(self, stages: Sequence[StageConfig]) -> tuple[StageConfig, ...]:
        """``stages`` (wrapped for tags), counting for this run.

        Each ``aggregate`` closes its groups at an epoch's end, and the one-to-many stages tell
        the points after them.
        """
        out: list[StageConfig] = []
        for index, stage in enumerate(stages):
            if isinstance(stage, AggregateConfig):
                point = next(point for at, point in self._points if at == index)
                point.after = self.account(index)
                stage = dataclasses.replace(stage, epochs=point)
            elif isinstance(stage, DisaggregateConfig):
                split = functools.partial(split_group, account=self.account(index))
                stage = dataclasses.replace(stage, split=split)
            elif stage.kind.many:
                op: Any = stage.op  # a TaggedGenerator or TaggedAsyncGenerator
                stage = dataclasses.replace(stage, op=type(op)(op.op, self.account(index)))
            out.append(stage)
        return tuple(out)
