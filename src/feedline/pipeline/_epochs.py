"""Where each epoch of a continuous run ends, at the consumer and at every ``aggregate``.

A continuous run numbers its source items across epochs (``_Passes`` records where each pass
ended), and an item belongs to the epoch of its (first) number. An epoch is over at a point of
the pipeline (a *checkpoint*: the consumer, or an ``aggregate``) when every item that carries
one of its numbers has reached that point or failed before it. One-to-one stages keep one item
per number; one-to-many stages (generators, ``disaggregate``) change the count, so they tell
the accounting as they go (``_resume.Account``), and so does a stage that skips a failed item.

Each checkpoint keeps, per number, the items still on their way to it (one, until a stage
changes it) and a :class:`~feedline.pipeline._resume.Progress` of the numbers with none left.
So the consumer knows when its loop's epoch is complete, and an ``aggregate`` closes an
epoch's last, partial group then, instead of filling it with the next epoch's items.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast

from ._defs import AggregateConfig, DisaggregateConfig, OpKind, PipeConfig, StageConfig
from ._resume import Account, Progress, TaggedAsyncGenerator, TaggedGenerator, split_group

__all__ = ["Accounting", "Checkpoint"]


class _Passes(Protocol):
    def epoch_of(self, number: int) -> int: ...

    def complete(self, epoch: int, below: int) -> bool: ...


class Checkpoint:
    """The items on their way to one point of a continuous run, per source number.

    Args:
        passes: Where each epoch's numbers end.

    """

    def __init__(self, passes: _Passes) -> None:
        self._passes = passes
        self.after: Account | None = None  # an aggregate's: the points after it
        self._done = Progress()
        # Numbers whose count is not one, nor done: under the lock of ``_done``, which they
        # move into.
        self._left: dict[int, int] = {}

    def change(self, tag: int | tuple[int, ...], change: int) -> None:
        """Add ``change`` to the items on their way for each number of ``tag``."""
        done = self._done
        with done.lock:
            for number in (tag,) if isinstance(tag, int) else tag:
                left = self._left.get(number, 1) + change
                if left:
                    self._left[number] = left
                else:
                    self._left.pop(number, None)
                    done.mark_held(number)

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
    """The checkpoints of one continuous run, and what changes their counts.

    Args:
        passes: Where each epoch's numbers end.
        stages: The run's stages, in order; each ``aggregate`` gets a checkpoint, and the
            consumer one after the last stage.

    """

    def __init__(self, passes: _Passes, stages: Sequence[StageConfig]) -> None:
        self._points = [
            (index, Checkpoint(passes))
            for index, stage in enumerate(stages)
            if isinstance(stage, AggregateConfig)
        ]
        self.consumer = Checkpoint(passes)
        self._points.append((len(stages), self.consumer))
        self._index = {stage.name: index for index, stage in enumerate(stages)}

    def checkpoint(self, index: int) -> Checkpoint:
        """The checkpoint of the ``aggregate`` at ``stages[index]``."""
        return next(point for at, point in self._points if at == index)

    def account(self, index: int) -> Account:
        """What the one-to-many stage at ``stages[index]`` tells: the points after it."""
        after = [point for at, point in self._points if at > index]

        def change(tag: int | tuple[int, ...], change: int) -> None:
            for point in after:
                point.change(tag, change)

        return change

    def failed(self, tag: int | tuple[int, ...], stage: str) -> None:
        """The stage named ``stage`` skipped an item: it reaches none of the points after."""
        self.account(self._index[stage])(tag, -1)

    def counted(self, stages: Sequence[StageConfig]) -> tuple[StageConfig, ...]:
        """``stages`` (wrapped for tags), counting for this run.

        The one-to-many ones tell the checkpoints after them, and each ``aggregate`` closes
        its groups at the end of an epoch.
        """
        out: list[StageConfig] = []
        for index, stage in enumerate(stages):
            if isinstance(stage, AggregateConfig):
                point = self.checkpoint(index)
                point.after = self.account(index)
                stage = dataclasses.replace(stage, epochs=point)
            elif isinstance(stage, DisaggregateConfig) and stage.split is split_group:
                stage = dataclasses.replace(stage, split=_counted_split(self.account(index)))
            elif isinstance(stage, PipeConfig) and stage.kind in (
                OpKind.GENERATOR,
                OpKind.ASYNC_GENERATOR,
            ):
                op, account = stage.op, self.account(index)
                counted: Any = (
                    TaggedGenerator(op.op, account)
                    if isinstance(op, TaggedGenerator)
                    else TaggedAsyncGenerator(cast(TaggedAsyncGenerator, op).op, account)
                )
                stage = dataclasses.replace(stage, op=counted)
            out.append(stage)
        return tuple(out)


def _counted_split(account: Account) -> Callable[[Any], Iterable[Any]]:
    def split(item: Any) -> Iterable[Any]:
        return split_group(item, account)

    return split
