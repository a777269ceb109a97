"""Dealing an epoch's batches to the worker processes as they need them.

The parent draws batches from the sampler lazily. A worker gets a first hand when the epoch
starts (with its start-up arguments when it starts for this epoch), dealt round-robin, then:

* ``in_order=True``: batch ``i`` of the epoch goes to worker ``i % W``, as in PyTorch (in a
  resumed epoch too), in rounds whose size doubles, each one message per worker, so that the
  parent keeps every worker a few batches ahead without drawing the whole epoch first: an
  ImageNet-sized shuffled epoch drew its 40,000 batches (about 0.4 s on one core) before the
  first one could start;
* ``in_order=False``: the next batch goes to the next worker (round the workers) that holds
  fewer than its share, one batch per message, as PyTorch's ``_try_put_index`` puts it: a
  worker that hands out its batches gets the next ones, and a slow one holds no more than
  its first hand (the batches are handed out in any order: one dealt to it would wait).

Messages on a worker's queue, each tagged with the epoch's number:

* ``("start", epoch, base_seed, tasks, dataset_state, last, taken, iterates, between,
  seed)``: the epoch's first hand (``taken``: for an iterable dataset, the worker's batches
  handed out before a resume; ``iterates``: its saved state is loaded after ``iter()``;
  ``between``: the state was saved between epochs, the worker seeds itself again after
  loading it; ``seed``: what its global generators are seeded from, ``base_seed`` unless the
  workers started part-way through the epoch);
* ``("more", epoch, tasks, last)``: the next hand; ``last`` ends the worker's share.

A worker skips messages of other epochs (hands dealt to an epoch it left early).
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Callable, Iterator
from typing import Any

from ._fetch import Task

__all__ = ["Dealer", "TaskStream", "read_start"]

_MAX_ROUND = 256
"""The most batches a worker is dealt at once (one message)."""

_POLL = 0.2  # seconds between checks of the consumer's stop while waiting for a hand


class Dealer:
    """Deals ``tasks`` (an epoch's numbered batches, drawn lazily) to ``workers`` workers.

    Args:
        tasks: The epoch's batches in order; drawn only as far as dealt.
        workers: How many workers share them.
        ahead: Batches a worker has in flight (its prefetch): it is dealt more before it
            holds fewer than this beyond those handed out.
        first: The number of the first batch: a resumed epoch's batch ``n`` goes to worker
            ``n % workers``, as in the epoch it resumes, whose workers' datasets' states it
            restores (its first hands, with ``in_order=False``).
        in_order: Batch ``i`` goes to worker ``i % workers`` (else to a worker with room).

    """

    def __init__(
        self,
        tasks: Iterator[Task],
        workers: int,
        ahead: int,
        first: int = 0,
        *,
        in_order: bool = True,
    ) -> None:
        self._tasks = tasks
        self._workers = workers
        self._first = first % workers if workers else 0
        # in_order=True keeps one more dealt, so that a worker's next round is there before
        # it runs out; in_order=False deals a worker at most ``ahead``, as PyTorch does.
        self._low = max(1, ahead) + (1 if in_order else 0)
        self._round = self._low
        self._held = [0] * workers  # dealt to each worker and not handed out yet
        self._in_order = in_order
        self._next = self._first  # in_order=False: the worker offered the next batch first
        self.dealt = 0  # batches dealt so far (see owner)
        self.exhausted = False

    def first_hands(self) -> list[list[Task]]:
        """Each worker's first hand (:attr:`exhausted` says whether that is the whole epoch)."""
        return self._draw()

    def top_up(self, send: Callable[[int, list[Task], bool], None]) -> None:
        """Deal another round if a worker holds fewer batches than it should.

        ``send(worker, tasks, last)`` delivers a hand; every worker gets one per round, and
        the round that reaches the end of the epoch tells each that its share is complete.
        """
        if self.exhausted or min(self._held) >= self._low:
            return
        if not self._in_order:
            self._deal_to_free(send)
            return
        self._round = min(_MAX_ROUND, 2 * self._round)
        for worker, hand in enumerate(self._draw()):
            send(worker, hand, self.exhausted)

    def _deal_to_free(self, send: Callable[[int, list[Task], bool], None]) -> None:
        # in_order=False: a batch to each worker with room, the next one round the workers
        # first; the epoch's end tells every worker its share is complete.
        while True:
            worker = next(
                (
                    w % self._workers
                    for w in range(self._next, self._next + self._workers)
                    if self._held[w % self._workers] < self._low
                ),
                None,
            )
            if worker is None:
                return
            drawn = list(itertools.islice(self._tasks, 1))
            if not drawn:
                self.exhausted = True
                for w in range(self._workers):
                    send(w, [], True)
                return
            self._next = worker + 1
            self._held[worker] += 1
            self.dealt += 1
            send(worker, drawn, False)

    def owner(self, i: int) -> int:
        """The worker that was dealt the ``i``-th batch dealt (``in_order=True``)."""
        return (self._first + i) % self._workers

    def handed_out(self, worker: int) -> None:
        """One of ``worker``'s batches reached the consumer."""
        self._held[worker] -= 1

    def holds(self, worker: int) -> int:
        """Batches dealt to ``worker`` and not handed out yet."""
        return self._held[worker]

    def _draw(self) -> list[list[Task]]:
        wanted = self._round * self._workers
        drawn = list(itertools.islice(self._tasks, wanted))
        if len(drawn) < wanted:
            self.exhausted = True
        hands: list[list[Task]] = [[] for _ in range(self._workers)]
        for k, task in enumerate(drawn):
            hands[(self._first + self.dealt + k) % self._workers].append(task)
        for worker, hand in enumerate(hands):
            self._held[worker] += len(hand)
        self.dealt += len(drawn)
        return hands


def read_start(get: Callable[[], Any]) -> tuple[Any, ...]:
    """The next epoch's start message from a worker's queue, skipping other epochs' hands."""
    while True:
        message: tuple[Any, ...] = get()
        if message[0] == "start":
            return message


class TaskStream:
    """A worker's share of one epoch: its first hand, then the hands that follow.

    Iterable, and interruptible as a pipeline's source (``iter_until``): waiting for the next
    hand ends once the pipeline stops.
    """

    def __init__(self, q: Any, epoch: int, first: list[Task], last: bool) -> None:
        self._queue = q
        self._epoch = epoch
        self._hand = list(first)  # dealt and not taken yet
        self._last = last

    def __iter__(self) -> Iterator[Task]:
        return self.iter_until(lambda: False)

    @property
    def complete(self) -> bool:
        """Whether every batch of the share was taken."""
        return self._last and not self._hand

    def take(self, count: int | None) -> Iterator[Task]:
        """The next ``count`` batches (``None``: all), taken out of the share."""
        taken = 0
        while count is None or taken < count:
            if not self._hand:
                if self._last or count is not None:
                    return  # the rest comes through iter_until
                self._more(lambda: False)
                continue
            taken += 1
            yield self._hand.pop(0)

    def _more(self, stopping: Callable[[], bool]) -> bool:
        # Wait for this epoch's next hand into _first; False once stopping() says so.
        while True:
            try:
                message = self._queue.get(timeout=_POLL)
            except queue.Empty:
                if stopping():
                    return False
                continue
            if message[0] != "more" or message[1] != self._epoch:
                continue  # a hand of an epoch this worker left early
            _, _, tasks, self._last = message
            self._hand.extend(tasks)
            return True

    def iter_until(self, stopping: Callable[[], bool]) -> Iterator[Task]:
        """The share's batches not taken yet, ending early once ``stopping()`` is true."""
        while True:
            while self._hand:
                yield self._hand.pop(0)
            if self._last or not self._more(stopping):
                return
