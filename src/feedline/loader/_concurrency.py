"""``DataLoader(fetch_concurrency=...)``: a number of calls at once, or ``"auto"``.

A number fixes the threads that call ``dataset[i]`` (per process) and leaves the batches in
flight at ``prefetch_factor``. ``"auto"`` (or :class:`~feedline.Auto` with bounds on the calls
at once) hands both to rules that adapt them: the fetcher's pool may grow to ``Auto.high``
threads, its calls at once set by :func:`~._calls.decide_calls` from the fetcher's
measurements (more while the cores are idle and calls wait), and the fetch stage's batches in
flight become a tuned knob of the pipeline (:mod:`feedline.pipeline._tuner`), raised while the
consumer waits for batches and more of them in flight bring more out. Items that wait on a slow
store get hundreds of calls at once; items that compute keep about one per core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from feedline.errors import ConfigurationError
from feedline.pipeline import Auto

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

    def batches(self, in_flight: int, batch_size: int, settled: int | None = None) -> int | Auto:
        """The fetch stage's concurrency: batches fetched at once.

        Fixed: ``in_flight`` (``prefetch_factor``). Tuned: up to enough batches to keep every
        thread busy, four times over (batches come in order: one whose last item is late
        holds those behind it, done, in the window; measured over a store whose GETs take 20
        ms at the median and 200 ms at p99, 8 batches of 32 gave 1,130 objects/s, 16 gave
        2,200, and 2,900 without the tail),
        starting from ``in_flight``, or from where the last epoch's tuner left it
        (``settled``), and never below ``in_flight``, as PyTorch keeps that many in flight:
        with one batch at a time, the threads idle while each batch's slowest items finish
        (and a window of a few batches is too noisy to tell, measured: a 30 ms GET + decode
        epoch lowered to one batch, "as fast", ran at 650 items/s where two ran 690).
        """
        if self.auto is None:
            return in_flight
        high = max(in_flight, 4 * math.ceil(self.threads / max(1, batch_size)))
        start = in_flight if settled is None else max(in_flight, min(high, settled))
        return Auto(low=in_flight, high=high, start=start)
