"""What every stage shares: its run and channels, input order, failure accounting and logging."""

from __future__ import annotations

import contextlib
import logging
from concurrent import futures
from typing import TYPE_CHECKING, Any

from feedline._failures import LogThrottle
from feedline.errors import PipelineFailure

from .._queue import EMPTY, Channel
from .._resume import Tagged, sample_repr
from .._settings import CHEAP_BELOW
from ..stats import StageCounters

if TYPE_CHECKING:
    from .._engine import Run

__all__ = ["InputOrder", "StageBase"]

_log = logging.getLogger("feedline.pipeline")


class InputOrder:
    """``output_order="input"``: items numbered as they are taken, results handed on in order.

    Early results wait in ``pending``; a stage runs at most ``ahead`` (twice its concurrency:
    measured, 25% more throughput than once) items past the oldest not handed on. Not locked:
    a threaded stage numbers under its take lock and hands on under its emit lock; a loop
    stage runs on the loop's thread.
    """

    __slots__ = ("ahead", "next_emit", "next_seq", "pending")

    def __init__(self, concurrency: int) -> None:
        self.ahead = 2 * concurrency
        self.next_seq = 0  # the number of the next item taken
        self.next_emit = 0  # the number of the next result to hand on
        self.pending: dict[int, Any] = {}  # results by number, until handed on

    def full(self) -> bool:
        """Whether the stage is ``ahead`` items past the oldest not handed on."""
        return self.next_seq - self.next_emit >= self.ahead

    def number(self) -> int:
        """The number of an item just taken."""
        seq = self.next_seq
        self.next_seq = seq + 1
        return seq

    def head(self) -> Any:
        """The next result to hand on, or ``EMPTY`` while it is not done."""
        return self.pending.get(self.next_emit, EMPTY)

    def advance(self) -> None:
        """The head was handed on (or skipped)."""
        del self.pending[self.next_emit]
        self.next_emit += 1


class StageBase:
    """Failure handling, statistics and channels common to all stage runtimes.

    A stage reads ``_input`` (``None`` for a source), writes ``_output``, and runs at most
    ``_concurrency`` calls at once, in input order if ``_order`` is set.
    """

    def __init__(
        self,
        run: Run,
        name: str,
        kind: str,
        concurrency: int,
        input: Channel | None,
        output: Channel,
        ordered: bool = False,
    ) -> None:
        self.run = run
        self.name = name
        self.counters = StageCounters(name, kind, concurrency)
        self._throttle = LogThrottle()
        self._input = input
        self._output = output
        self._concurrency = concurrency
        self._order = InputOrder(concurrency) if ordered else None

    def on_data(self) -> None:
        """Input arrived or closed (a source has none)."""

    def on_space(self) -> None:
        """The output, full before, drained to half (or closed)."""

    def _set_concurrency(self, concurrency: int) -> None:
        # The tuner's call (any thread); the stage then starts or ends jobs or workers.
        self._concurrency = concurrency
        if self._order is not None:
            self._order.ahead = 2 * concurrency
        self.counters.set_concurrency(concurrency)

    def cheap(self) -> bool:
        """Whether the op's smoothed time is below :data:`CHEAP_BELOW` (a thread wake-up)."""
        return 0 <= self.counters.ewma < CHEAP_BELOW

    def record_failure(self, item: Any, error: Exception) -> None:
        """Count a failed item, log it (rate-limited), and stop the run past the budget.

        The item is named by its value and, for a ``Tagged`` one, by its source item. A call
        that a stopping run's process pool cancelled is not the item's failure: not counted.
        """
        if isinstance(error, futures.CancelledError) and self.run.life.stopping:
            return
        c = self.counters
        if isinstance(item, Tagged):
            sample, source = sample_repr(item.value), item.source()
        else:
            sample, source = sample_repr(item), None
        where = f" ({source})" if source is not None else ""
        with c.lock:
            c.failures += 1
            failures, items = c.failures, c.items_in
            more = self._throttle.admit(f"sample {sample}{where}: {type(error).__name__}: {error}")
        if more is not None:
            _log.warning(
                "stage %r failed on sample %s%s: %s: %s [%d failure(s) so far]%s",
                self.name,
                sample,
                where,
                type(error).__name__,
                error,
                failures,
                more,
                exc_info=error if failures == 1 else None,
            )
        budget = self.run.budget
        if budget.exceeded(failures, items):
            self.flush_failures()
            failure = PipelineFailure(
                self.name, failures, items, sample, error, budget.description, source=source
            )
            failure.__cause__ = error
            self.run.begin_stop(failure)
        elif not self.run.life.stopping:
            # Skipped for good: an item that stopped the run, or failed as it stopped, is not.
            self.run.item_failed(item, self.name)

    def close(self) -> None:
        """Close the iterators of user code this stage holds. Call once no job runs."""

    def flush_failures(self) -> None:
        """Log, in one line, the failures the throttle held back since its last message."""
        with self.counters.lock:
            (held, last), failures = self._throttle.take_held(), self.counters.failures
        if held:
            _log.warning(
                "stage %r: %d more failed sample(s) not logged one by one; the last: %s "
                "[%d failure(s) in all]",
                self.name,
                held,
                last,
                failures,
            )


def close_quietly(iterator: Any) -> None:
    """Close ``iterator`` if it can be (a generator's ``finally`` runs); errors are dropped."""
    close = getattr(iterator, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):  # best effort: the run is over
            close()
