"""What every stage shares: its run and channels, input order, failure accounting and logging."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any, Protocol

from feedline._failures import FailureBudget, LogThrottle
from feedline.errors import PipelineFailure

from .._lifecycle import RunLifecycle
from .._queue import EMPTY, Channel
from .._resume import Tagged, sample_repr
from .._settings import CHEAP_BELOW
from ..stats import StageCounters

__all__ = ["FailureBudget", "InputOrder", "RunContext", "StageBase"]

_log = logging.getLogger("feedline.pipeline")


class RunContext(Protocol):
    """What a stage may ask of the running pipeline."""

    loop: asyncio.AbstractEventLoop
    life: RunLifecycle  # ``life.stopping``: the flag behind ``stopping``, read per item

    @property
    def stopping(self) -> bool:
        """True once the run is stopping; stages must stop taking work."""

    def submit(self, executor: Any, fn: Callable[[], None]) -> bool:
        """Run ``fn`` in ``executor``, tracked so that stop() can wait for it."""

    def fail(self, error: BaseException) -> None:
        """Stop the run; the consumer's next get raises ``error``."""

    def item_failed(self, item: Any, stage: str) -> None:
        """The stage named ``stage`` failed on ``item`` within the budget, skipping it."""

    def on_loop_thread(self) -> bool:
        """Whether the caller is the event-loop thread."""

    async def call_in_executor(self, executor: Any, fn: Callable[[Any], Any], item: Any) -> Any:
        """Await ``fn(item)`` run in a non-thread executor; stop() waits for such calls."""


class InputOrder:
    """``output_order="input"``: items numbered as they are taken, results handed on in order.

    Results that finish early are held (``pending``) until those before them are handed on,
    and a stage runs at most ``ahead`` items past the oldest one not handed on: twice its
    concurrency, since with only ``concurrency`` a call that finished early would wait idle
    for one slow item (measured: 25% less throughput decoding JPEGs on two threads). Not
    locked: a threaded stage numbers items under its take lock and hands results on under
    its hand-over lock; a loop stage runs on the loop's thread.
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
        run: RunContext,
        name: str,
        kind: str,
        concurrency: int,
        budget: FailureBudget,
        input: Channel | None,
        output: Channel,
        ordered: bool = False,
    ) -> None:
        self.run = run
        self.name = name
        self.counters = StageCounters(name, kind, concurrency)
        self._budget = budget
        self._throttle = LogThrottle()
        self._input = input
        self._output = output
        self._concurrency = concurrency
        self._order = InputOrder(concurrency) if ordered else None

    def _set_concurrency(self, concurrency: int) -> None:
        # Run at most ``concurrency`` calls from now on (the tuner's call, any thread); a
        # stage then starts or ends its jobs or workers.
        self._concurrency = concurrency
        if self._order is not None:
            self._order.ahead = 2 * concurrency
        self.counters.set_concurrency(concurrency)

    def cheap(self) -> bool:
        """Whether the op's smoothed time is below :data:`CHEAP_BELOW` (a thread wake-up)."""
        return 0 <= self.counters.ewma < CHEAP_BELOW

    def record_failure(self, item: Any, error: Exception) -> None:
        """Count a failed item, log it (rate-limited), and stop the run past the budget.

        The item is named by its value and, for an item that carries it (``Tagged``, see
        ``_resume``), by the source item it came from. A call that a stopping run's process
        pool cancelled is not the item's failure: nothing is counted.
        """
        if isinstance(error, futures.CancelledError) and self.run.stopping:
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
        if self._budget.exceeded(failures, items):
            self.flush_failures()
            failure = PipelineFailure(
                self.name, failures, items, sample, error, self._budget.description, source=source
            )
            failure.__cause__ = error
            self.run.fail(failure)
        elif not self.run.stopping:
            # Skipped for good (within the budget, in a run that goes on): an item that
            # stopped the run, or failed as it stopped, is not.
            self.run.item_failed(item, self.name)

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
