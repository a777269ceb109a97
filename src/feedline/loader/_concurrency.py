"""``DataLoader(fetch_concurrency=...)``: a number of calls at once, or ``"auto"``.

A number fixes the threads that call ``dataset[i]`` (per process). ``"auto"`` (or
:class:`~feedline.Auto` with bounds on the calls at once) lets the fetcher's pool grow to
``Auto.high`` threads, its calls at once set by :func:`~._calls.decide_calls` from the
fetcher's measurements (more while the cores are idle and calls wait): items that wait on a
slow store get hundreds of calls at once; items that compute keep about one per core. Either
way the batches in flight follow the calls at once (see :mod:`~._ahead`): a batch is drawn
when the threads have room for it and fewer than ``prefetch_factor`` are ahead of the
consumer, or more while it waits for one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from feedline.errors import ConfigurationError
from feedline.pipeline import Auto

from ._ahead import ITEMS_PER_CALL

__all__ = ["FETCH_HIGH", "FetchConcurrency"]

FETCH_HIGH = 128
"""The most ``dataset[i]`` calls at once (threads, per process) under ``"auto"``, unless
``Auto(high=...)`` says otherwise: 1,280 items/s at 100 ms per item."""


@dataclass(frozen=True)
class FetchConcurrency:
    """What ``fetch_concurrency`` asks for.

    Attributes:
        threads: The most calls of ``dataset[i]`` at once, per process.
        auto: The bounds on calls at once when tuned, else ``None``.

    """

    threads: int
    auto: Auto | None = None

    @property
    def least(self) -> int:
        """The fewest calls at once the fetcher lowers to (``Auto.low``)."""
        return self.auto.low if self.auto is not None else 1

    @property
    def start(self) -> int | None:
        """The calls at once the fetcher begins with (``Auto.start``), if given."""
        return self.auto.start if self.auto is not None else None

    @staticmethod
    def parse(value: object) -> FetchConcurrency:
        """From the argument: ``None`` (default, ``"auto"``), an int, ``"auto"``, an ``Auto``."""
        if value is None or (isinstance(value, str) and value == "auto"):
            value = Auto()
        if isinstance(value, Auto):
            high = value.high if value.high is not None else max(FETCH_HIGH, value.low)
            return FetchConcurrency(high, value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(
                "fetch_concurrency must be an int >= 1, 'auto' or feedline.Auto(low, high), "
                f"got {value!r}"
            )
        return FetchConcurrency(value)

    def batches(self, in_flight: int, batch_size: int) -> int:
        """The most batches the fetch stage holds at once, started and not yet taken.

        Enough for :data:`~._ahead.ITEMS_PER_CALL` items per thread, and never fewer than
        ``in_flight`` + 1. Which of them start when is the fetcher's to decide
        (:mod:`~._ahead`): batches wait for their slowest item and come out in order, so a
        late item holds the batches behind it, done.
        """
        return max(in_flight + 1, math.ceil(ITEMS_PER_CALL * self.threads / max(1, batch_size)))
