"""Fetching the items of a batch concurrently, and what happens when an item fails.

A batch's indices are fetched at once: one ``dataset[i]`` call per index on a thread pool, all
awaited together on the pipeline's event loop. A failing call does not fail the batch: it is
returned as a :class:`FailedItem`, and :class:`FailureTally` (in the consumer's process) logs it,
counts it against the loader's budget and drops it, so the batch comes out one item smaller.
Past the budget, :class:`FailureTally` raises :class:`~feedline.PipelineFailure`, naming the
sample's index and the last error.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from feedline.errors import PipelineFailure
from feedline.pipeline._stages._common import FailureBudget

__all__ = ["BatchFetcher", "FailedItem", "FailureTally", "Task"]

_log = logging.getLogger("feedline.loader")

Task = tuple[int, list[Any]]
"""(batch number in the epoch, the indices of its items)."""


@dataclass(frozen=True)
class FailedItem:
    """An item whose ``dataset[index]`` raised; picklable, whatever the exception was."""

    index: Any
    error_type: str
    message: str
    traceback: str
    error: BaseException | None = None  # kept in-process; dropped when it cannot be pickled

    def __reduce__(self) -> tuple[Any, ...]:
        import pickle

        error = self.error
        try:
            pickle.dumps(error)
        except Exception:
            error = None
        return (FailedItem, (self.index, self.error_type, self.message, self.traceback, error))


class BatchFetcher:
    """Fetches a batch's items on its own thread pool, ``concurrency`` calls at a time.

    Args:
        dataset: Anything with ``__getitem__``.
        concurrency: Threads of the pool (calls of ``dataset[i]`` in flight at once).

    """

    def __init__(self, dataset: Any, concurrency: int) -> None:
        self._dataset = dataset
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="feedline-fetch")

    def _get(self, index: Any) -> Any:
        try:
            return self._dataset[index]
        except Exception as error:
            return FailedItem(
                index, type(error).__name__, str(error), traceback.format_exc(), error
            )

    async def fetch(self, task: Task) -> tuple[int, list[Any]]:
        """Return ``(batch number, items)``, a :class:`FailedItem` where a call raised."""
        number, indices = task
        loop = asyncio.get_running_loop()
        items = await asyncio.gather(
            *(loop.run_in_executor(self._pool, self._get, i) for i in indices)
        )
        return number, list(items)

    def fetch_one(self, index: Any) -> Any:
        """Fetch one item in the calling thread (for loaders without automatic batching)."""
        return self._get(index)

    def close(self) -> None:
        """Stop the threads; calls not started yet are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class FailureTally:
    """Drops failed items from batches, logs them (rate-limited) and enforces the budget."""

    def __init__(self, max_failures: int | float | None) -> None:
        self._budget = FailureBudget(max_failures)
        self.failures = 0
        self.items = 0
        self._last_log = 0.0
        self._unlogged = 0

    def keep(self, items: list[Any]) -> list[Any]:
        """The items that did not fail; raises once failures exceed the budget."""
        self.items += len(items)
        good = [x for x in items if not isinstance(x, FailedItem)]
        for failed in (x for x in items if isinstance(x, FailedItem)):
            self._record(failed)
        return good

    def _record(self, failed: FailedItem) -> None:
        self.failures += 1
        now = time.monotonic()
        if self.failures == 1 or now - self._last_log >= 1.0:
            more = f" ({self._unlogged} more since the last message)" if self._unlogged else ""
            _log.warning(
                "dataset[%r] failed and was skipped: %s: %s [%d failure(s) so far]%s%s",
                failed.index,
                failed.error_type,
                failed.message,
                self.failures,
                more,
                "\n" + failed.traceback if self.failures == 1 else "",
            )
            self._last_log, self._unlogged = now, 0
        else:
            self._unlogged += 1
        if self._budget.exceeded(self.failures, self.items):
            error = failed.error or RuntimeError(f"{failed.error_type}: {failed.message}")
            failure = PipelineFailure(
                "dataset.__getitem__",
                self.failures,
                self.items,
                repr(failed.index),
                error,
                self._budget.description,
                hint="raise the budget with DataLoader(max_failures=...)",
            )
            raise failure from error
