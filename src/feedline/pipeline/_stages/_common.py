"""What every stage shares: the run it belongs to, failure accounting and logging."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from feedline._failures import FailureBudget, LogThrottle
from feedline.errors import PipelineFailure

from .._resume import Tagged, sample_repr
from .._settings import CHEAP_BELOW
from ..stats import StageCounters

__all__ = ["FailureBudget", "RunContext", "StageBase"]

_log = logging.getLogger("feedline.pipeline")


class RunContext(Protocol):
    """What a stage may ask of the running pipeline."""

    loop: asyncio.AbstractEventLoop

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


class StageBase:
    """Failure handling and statistics common to all stage runtimes."""

    def __init__(
        self, run: RunContext, name: str, kind: str, concurrency: int, budget: FailureBudget
    ) -> None:
        self.run = run
        self.name = name
        self.counters = StageCounters(name, kind, concurrency)
        self._budget = budget
        self._throttle = LogThrottle()

    def cheap(self) -> bool:
        """Whether the op's smoothed time is below :data:`CHEAP_BELOW` (a thread wake-up)."""
        return 0 <= self.counters.ewma < CHEAP_BELOW

    def record_failure(self, item: Any, error: Exception) -> None:
        """Count a failed item, log it (rate-limited), and stop the run past the budget.

        The item is named by its value and, for an item that carries it (``Tagged``, see
        ``_resume``), by the source item it came from.
        """
        c = self.counters
        if isinstance(item, Tagged):
            sample, source = sample_repr(item.value), item.source()
        else:
            sample, source = sample_repr(item), None
        where = f" ({source})" if source is not None else ""
        with c.lock:
            c.failures += 1
            c.last_error = error
            c.last_sample = sample
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
