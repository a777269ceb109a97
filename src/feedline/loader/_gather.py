"""Taking an epoch's batches from the worker processes, in the parent.

A :class:`WorkerEpoch` is what :class:`~._workers.WorkerSet` returns for an epoch: iterated
(by the consumer's thread, or as a pipeline's source), it takes each worker's batches from
its :class:`~feedline.SubprocessIterable` and, for a map-style dataset, deals the workers
more batches as they hand theirs out (:mod:`._deal`). The order:

* a map-style dataset with ``in_order=True``: batch ``i`` from the worker it was dealt to,
  ``i % W``, as PyTorch;
* ``in_order=False``: each worker's next batch as soon as it is there, so that a slow batch
  holds up only its own worker (and the next batch is dealt to a worker with room);
* an iterable dataset: the workers' batches in turn (``in_order=False``: as they come), each
  worker left out once its iterator ends, as PyTorch takes them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_for
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

from feedline._proc.settings import CHILD_POLL
from feedline._proc.subprocess import Abandoned

from ._deal import Dealer
from ._fetch import Task

if TYPE_CHECKING:
    from ._workers import WorkerSet

__all__ = ["StateReport", "StreamMark", "Turns", "WorkerEpoch"]

_SETTLE_SECONDS = 1.0
"""How long persistent workers left mid-epoch get to finish their batch before they are ended
(and started anew by the next epoch)."""

Fetched: TypeAlias = tuple[int, Any, Any]
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


class StateReport(NamedTuple):
    """A worker's report of its dataset's state outside a batch (a stateful dataset).

    Sent in the place of a batch: first in each pass, after the dataset's saved state was
    loaded (and, for an iterable dataset, ``iter()`` called), and, for an iterable dataset,
    last, once its iterator ended.

    Attributes:
        state: The dataset's ``state_dict()``.
        iterates: The iterable dataset is its own iterator (``iter()`` returned it).
        ended: After the iterator ended (else: as the pass starts).

    """

    state: Any
    iterates: bool
    ended: bool


Reporter: TypeAlias = Callable[[int, Any, bool], None]
"""Called with a worker, its dataset's state as its pass starts, and whether the dataset is
its own iterator."""


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
    """One epoch over the workers: iterable, and interruptible as a pipeline's source.

    Args:
        workers: The workers, each told its share of the epoch already.
        dealer: Deals a map-style dataset's batches to the workers; :class:`Turns` for an
            iterable dataset's.
        number: The epoch's number, which tags the hands dealt to it.
        report: For a stateful dataset, what records each worker's :class:`StateReport` as
            its pass starts (each sends one before its first batch); ``None`` otherwise.

    """

    def __init__(
        self,
        workers: WorkerSet,
        dealer: Dealer | Turns,
        number: int,
        report: Reporter | None = None,
    ) -> None:
        count = len(workers.processes)
        self._workers = workers
        self._dealer = dealer
        self._number = number
        self._report = report
        self.begun = False
        self._stopping: Callable[[], bool] | None = None
        self._iterators: list[Iterator[Fetched]] | None = None
        self._running = False  # _run took over the iterators (and settles them)
        self._waiting_since: float | None = None  # on every worker at once, since when
        # Per worker: whether its start-up report was taken (nothing to take without one),
        # and a message or error taken ahead of the epoch's own reading (read_reports).
        self._started = [report is None] * count
        self._ahead: list[Fetched | BaseException | None] = [None] * count

    def __iter__(self) -> Iterator[Fetched]:
        return self.iter_until(None)

    def iter_until(self, stopping: Callable[[], bool] | None) -> Iterator[Fetched]:
        """Iterate, ending early once ``stopping()`` is true (see ``SubprocessIterable``)."""
        self.begun = True
        self._workers.begun(self)
        self._stopping = stopping
        return self._run()

    def read_reports(self) -> None:
        """Take the start-up report of each worker that has not sent a batch yet.

        Waits for those workers to start. For the consumer's thread, between batches (the
        epoch is not read elsewhere meanwhile). An error met on the way (the worker failed,
        or died) is raised where the epoch takes that worker's next batch, not here.
        """
        if not self.begun:
            return
        for w, started in enumerate(self._started):
            if started or self._ahead[w] is not None:
                continue
            try:
                fetched = self._step(w)
            except Exception as error:  # raised in its turn (KeyboardInterrupt: now)
                self._ahead[w] = error
                continue
            if fetched is not None:
                self._ahead[w] = fetched  # not a report after all: the epoch takes it

    def close(self) -> None:
        """Settle the workers' pass if the epoch was never iterated past its reports."""
        if self._iterators is not None and not self._running:
            self._settle(done=False)

    def _open(self) -> list[Iterator[Fetched]]:
        # Each worker's messages of this epoch.
        if self._iterators is None:
            self._iterators = iterators = []
            for process in self._workers.processes:
                iterators.append(process.iter_until(self._stopping, settle=False))
        return self._iterators

    def _step(self, w: int) -> Fetched | None:
        # Worker w's next message: a batch (or an ended stream's report), or None for its
        # start-up report, which goes to the reporter. StopIteration at the end of its pass.
        ahead = self._ahead[w]
        if ahead is not None:
            self._ahead[w] = None
            if isinstance(ahead, BaseException):
                raise ahead
            return ahead
        fetched = next(self._open()[w])
        report = fetched[1]
        if isinstance(report, StateReport) and not report.ended:
            self._started[w] = True
            if self._report is not None:
                self._report(w, report.state, report.iterates)
            return None
        return fetched

    def _next(self, w: int) -> Fetched:
        # Worker w's next batch, past its start-up report.
        while True:
            fetched = self._step(w)
            if fetched is not None:
                return fetched

    def _ready(self, candidates: list[int]) -> list[int]:
        # Those of the candidate workers with a message to take, after a short wait.
        ahead = [w for w in candidates if self._ahead[w] is not None]
        if ahead:
            return ahead
        processes = self._workers.processes
        handles = {h: w for w in candidates for h in processes[w].wait_handles()}
        ready = wait_for(list(handles), timeout=CHILD_POLL)
        if self._stopping is not None and self._stopping():
            raise Abandoned
        if ready:
            self._waiting_since = None
        else:  # nothing from any of them yet: the stall watch is ticked
            if self._waiting_since is None:
                self._waiting_since = time.monotonic()
            self._workers.watch.tick(self._waiting_since)
        return sorted({handles[h] for h in ready})

    def _run(self) -> Iterator[Fetched]:
        workers, dealer, number = self._workers, self._dealer, self._number
        done = False

        def send(worker: int, tasks: list[Task], last: bool) -> None:
            workers.send(worker, ("more", number, tasks, last))

        try:
            self._running = True
            iterators = self._open()
            try:
                if isinstance(dealer, Turns):
                    yield from self._streams(dealer)
                elif workers.in_order:
                    yield from self._in_turn(dealer, send)
                else:
                    yield from self._as_they_come(dealer, send)
            except Abandoned:
                return  # the pipeline stopped meanwhile: settled below
            for it in iterators:  # let each child end its pass
                for _ in it:
                    pass
            done = True
        finally:
            self._settle(done)

    def _settle(self, done: bool) -> None:
        # The epoch is over (done: every worker ended its pass) or left early.
        workers, dealer = self._workers, self._dealer
        processes = workers.processes
        if not done and not workers.persistent:
            workers.close()  # at once: nobody waits for a busy worker's current batch
        elif not done:
            # Persistent workers finish the batch they are on, within a common deadline.
            deadline = time.monotonic() + _SETTLE_SECONDS
            for worker, process in enumerate(processes):
                process.request_stop()
                if not dealer.exhausted:
                    # A worker waiting for its next hand would never see the stop: its share
                    # is complete.
                    with contextlib.suppress(OSError, ValueError):
                        workers.send(worker, ("more", self._number, [], True))
            for process in processes:
                process.settle(deadline)
        for it in self._iterators or []:
            it.close()  # type: ignore[attr-defined]

    def _in_turn(
        self, dealer: Dealer, send: Callable[[int, list[Task], bool], None]
    ) -> Iterator[Fetched]:
        # The epoch's batches in order: the i-th from the worker it was dealt to.
        i = 0
        while True:
            dealer.top_up(send)
            if i >= dealer.dealt:
                return
            w = dealer.owner(i)
            number, items, snapshot = self._next(w)
            dealer.handed_out(w)
            yield number, items, None if snapshot is None else (w, snapshot[1])
            i += 1

    def _as_they_come(
        self, dealer: Dealer, send: Callable[[int, list[Task], bool], None]
    ) -> Iterator[Fetched]:
        # in_order=False: take each worker's next batch as soon as it is there, so that a
        # slow batch holds up only the worker fetching it (as in PyTorch).
        for w, process in enumerate(self._workers.processes):
            if dealer.holds(w):
                process.wait_ready(self._stopping)
        while True:
            dealer.top_up(send)
            busy = [w for w in range(len(self._started)) if dealer.holds(w)]
            if not busy:
                return
            for w in self._ready(busy):
                fetched = self._step(w)  # raises if the worker died
                if fetched is None:
                    continue  # its start-up report
                number, items, snapshot = fetched
                dealer.handed_out(w)
                yield number, items, None if snapshot is None else (w, snapshot[1])

    def _streams(self, turns: Turns) -> Iterator[Fetched]:
        # An iterable dataset's batches: worker after worker (in_order=False: as they come),
        # each left out once its iterator ends, as PyTorch takes them.
        count = len(self._started)
        in_order = self._workers.in_order
        ended = [False] * count
        number, turn = turns.start, turns.turn
        expected = list(turns.taken)  # each worker's next batch number
        if not in_order:
            # Each child's first message says its iterable is made: taken with a batch, it
            # would hold up the others' batches until that worker's first (as _as_they_come).
            for process in self._workers.processes:
                process.wait_ready(self._stopping)
        while not all(ended):
            ready = [turn] if in_order else self._ready([w for w in range(count) if not ended[w]])
            for w in ready:
                turn = (w + 1) % count
                if ended[w]:
                    continue
                try:
                    # (In turn, its start-up report is passed over; as they come, it is all
                    # this worker has to say now.)
                    fetched = self._next(w) if in_order else self._step(w)
                except StopIteration:
                    ended[w] = True
                    continue
                if fetched is None:
                    continue
                batch, items, snapshot = fetched
                if isinstance(items, StateReport):
                    # Its iterator ended: the dataset's state after it, for the position.
                    ended[w] = True
                    yield number, items, (w, items.state)
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
