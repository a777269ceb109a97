"""Taking an epoch's batches from the worker processes, in the parent.

A :class:`WorkerEpoch` is what :class:`~._workers.WorkerSet` returns for an epoch: iterated
(by the consumer's thread, or as a pipeline's source), it takes each worker's batches from
its :class:`~feedline.SubprocessIterable` and, for a map-style dataset, deals the workers
more batches as they hand theirs out (:mod:`._deal`). The order:

* a map-style dataset with ``in_order=True``: batch ``i`` from the worker it was dealt to,
  ``i % W``, as PyTorch;
* ``in_order=False``: each worker's next batch as soon as it is there, so that a slow batch
  holds up only its own worker;
* an iterable dataset: the workers' batches in turn (``in_order=False``: as they come), each
  worker left out once its iterator ends, as PyTorch takes them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_for
from typing import TYPE_CHECKING, Any, NamedTuple

from feedline.pipeline._subprocess import _POLL, _Abandoned

from ._deal import Dealer
from ._fetch import Task

if TYPE_CHECKING:
    from ._workers import WorkerSet

__all__ = ["StreamMark", "Turns", "WorkerEpoch"]

_SETTLE_SECONDS = 1.0
"""How long persistent workers left mid-epoch get to finish their batch before they are ended
(and started anew by the next epoch)."""

Fetched = tuple[int, Any, Any]
"""A worker's message: (batch number, the collated batch, (worker, dataset state) or None)."""


class StreamMark(NamedTuple):
    """Where a batch of an iterable dataset came from, for the loader's position.

    Attributes:
        worker: The worker whose iterator gave it.
        batch: Its number among that worker's batches.
        state: The dataset's ``state_dict()`` in that worker after it (stateful datasets).

    """

    worker: int
    batch: int
    state: Any


class Turns:
    """An iterable dataset's epoch over the workers: whose batch comes next.

    Args:
        taken: Per worker, its batches the consumer had before a resume.
        turn: The worker whose turn is next.
        start: The epoch's number of the first batch to come.

    """

    exhausted = True  # nothing is dealt: every worker has its whole share

    def __init__(self, taken: list[int], turn: int, start: int) -> None:
        self.taken = taken
        self.turn = turn
        self.start = start


class WorkerEpoch:
    """One epoch over the workers: iterable, and interruptible as a pipeline's source."""

    def __init__(self, workers: WorkerSet, dealer: Dealer | Turns, number: int) -> None:
        self._workers = workers
        self._dealer = dealer
        self._number = number
        self.begun = False

    def __iter__(self) -> Iterator[Fetched]:
        return self.iter_until(None)

    def iter_until(self, stopping: Callable[[], bool] | None) -> Iterator[Fetched]:
        """Iterate, ending early once ``stopping()`` is true (see ``SubprocessIterable``)."""
        self.begun = True
        self._workers.begun(self)
        return self._run(stopping)

    def _run(self, stopping: Callable[[], bool] | None) -> Iterator[Fetched]:
        workers, dealer, number = self._workers, self._dealer, self._number
        processes = workers.processes
        iterators: list[Iterator[Fetched]] = []
        done = False

        def send(worker: int, tasks: list[Task], last: bool) -> None:
            workers.send(worker, ("more", number, tasks, last))

        try:
            for process in processes:
                iterators.append(process.iter_until(stopping, settle=False))
            try:
                if isinstance(dealer, Turns):
                    yield from self._streams(iterators, dealer, stopping)
                elif workers.in_order:
                    yield from self._in_turn(iterators, dealer, send)
                else:
                    yield from self._as_they_come(iterators, dealer, send, stopping)
            except _Abandoned:
                return  # the pipeline stopped meanwhile: settled below
            for it in iterators:  # let each child end its pass
                for _ in it:
                    pass
            done = True
        finally:
            if not done and not workers.persistent:
                workers.close()  # at once: nobody waits for a busy worker's current batch
            elif not done:
                # Persistent workers finish the batch they are on, within a common deadline.
                deadline = time.monotonic() + _SETTLE_SECONDS
                for worker, process in enumerate(processes):
                    process.request_stop()
                    if not dealer.exhausted:
                        # A worker waiting for its next hand would never see the stop:
                        # its share is complete.
                        with contextlib.suppress(OSError, ValueError):
                            workers.send(worker, ("more", number, [], True))
                for process in processes:
                    process.settle(deadline)
            for it in iterators:
                it.close()  # type: ignore[attr-defined]

    @staticmethod
    def _in_turn(
        iterators: list[Iterator[Fetched]],
        dealer: Dealer,
        send: Callable[[int, list[Task], bool], None],
    ) -> Iterator[Fetched]:
        # The epoch's batches in order: the i-th from the worker it was dealt to.
        i = 0
        while True:
            dealer.top_up(send)
            if i >= dealer.dealt:
                return
            w = dealer.owner(i)
            number, items, snapshot = next(iterators[w])
            dealer.handed_out(w)
            yield number, items, None if snapshot is None else (w, snapshot[1])
            i += 1

    def _as_they_come(
        self,
        iterators: list[Iterator[Fetched]],
        dealer: Dealer,
        send: Callable[[int, list[Task], bool], None],
        stopping: Callable[[], bool] | None,
    ) -> Iterator[Fetched]:
        # in_order=False: take each worker's next batch as soon as it is there, so that a
        # slow batch holds up only the worker fetching it (as in PyTorch).
        processes = self._workers.processes
        for w, process in enumerate(processes):
            if dealer.holds(w):
                process.wait_ready(stopping)
        while True:
            dealer.top_up(send)
            busy = [w for w in range(len(processes)) if dealer.holds(w)]
            if not busy:
                return
            handles = {h: w for w in busy for h in processes[w].wait_handles()}
            ready = wait_for(list(handles), timeout=_POLL)
            if stopping is not None and stopping():
                raise _Abandoned
            for w in {handles[h] for h in ready}:
                number, items, snapshot = next(iterators[w])  # raises if the worker died
                dealer.handed_out(w)
                yield number, items, None if snapshot is None else (w, snapshot[1])

    def _streams(
        self,
        iterators: list[Iterator[Fetched]],
        turns: Turns,
        stopping: Callable[[], bool] | None,
    ) -> Iterator[Fetched]:
        # An iterable dataset's batches: worker after worker (in_order=False: as they come),
        # each left out once its iterator ends, as PyTorch takes them.
        processes = self._workers.processes
        ended = [False] * len(iterators)
        number, turn = turns.start, turns.turn
        expected = list(turns.taken)  # each worker's next batch number
        while not all(ended):
            if self._workers.in_order:
                ready = [turn]
            else:
                handles = {
                    h: w
                    for w, done in enumerate(ended)
                    if not done
                    for h in processes[w].wait_handles()
                }
                ready = sorted({handles[h] for h in wait_for(list(handles), timeout=_POLL)})
                if stopping is not None and stopping():
                    raise _Abandoned
            for w in ready:
                turn = (w + 1) % len(iterators)
                if ended[w]:
                    continue
                try:
                    batch, items, snapshot = next(iterators[w])  # raises if the worker died
                except StopIteration:
                    ended[w] = True
                    continue
                if batch != expected[w]:
                    raise RuntimeError(
                        f"DataLoader worker {w} sent its batch {batch} where {expected[w]} was "
                        "due: a batch was lost on its way (see the worker's output)"
                    )
                expected[w] += 1
                state = None if snapshot is None else snapshot[1]
                yield number, items, StreamMark(w, batch, state)
                number += 1
