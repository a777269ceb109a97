"""What a user asks of the tuner: :class:`Auto` on a stage, :class:`Tuning` for a pipeline.

Config only, like :mod:`._defs`; :mod:`._tuner` does the tuning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from feedline._cores import usable_cores
from feedline.errors import ConfigurationError

from ._settings import LOOP_HIGH, THREAD_HIGH

__all__ = ["Auto", "Tuning"]


@dataclass(frozen=True)
class Auto:
    """A stage's concurrency, set by the pipeline while it runs (``pipe(concurrency=Auto())``).

    ``concurrency="auto"`` is ``Auto()``. The tuner raises the concurrency of the stage that
    limits throughput while that pays, and lowers it where it does not (see
    :meth:`PipelineBuilder.build`'s ``autotune``).

    Args:
        low: The least calls in flight (>= 1).
        high: The most calls in flight; ``None``: 32 for a stage on threads (within the
            pipeline's thread pool), 256 for a coroutine stage.
        start: Where it starts; ``None``: the cores this process may use for a stage on
            threads, 4 for a coroutine stage (within ``low`` and ``high``).

    """

    low: int = 1
    high: int | None = None
    start: int | None = None

    def __post_init__(self) -> None:
        for name in ("low", "high", "start"):
            value = getattr(self, name)
            if value is None and name != "low":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"Auto({name}=...) must be an int >= 1, got {value!r}")
        if self.high is not None and self.high < self.low:
            raise ConfigurationError(f"Auto(low={self.low}, high={self.high}): high < low")
        if self.start is not None and not (
            self.low <= self.start <= (self.high if self.high is not None else self.start)
        ):
            raise ConfigurationError(
                f"Auto(start={self.start}) must lie within low={self.low} and high={self.high}"
            )

    def bounds(self, on_loop: bool, pool: int | None) -> tuple[int, int, int]:
        """``(low, high, start)`` for a stage on the event loop or on threads.

        ``pool``: the most threads (or processes) the stage can get, if bounded.
        """
        high = self.high if self.high is not None else (LOOP_HIGH if on_loop else THREAD_HIGH)
        if pool is not None:
            high = min(high, pool)
        low = min(self.low, high)
        start = self.start if self.start is not None else (4 if on_loop else usable_cores())
        return low, high, max(low, min(high, start))


@dataclass(frozen=True)
class Tuning:
    """How a pipeline's tuner works (``build(autotune=..., memory_budget=..., cpu_budget=...)``).

    Attributes:
        memory_budget: The most bytes of items held in queues and in flight, or ``None``.
        cpu_budget: Cores the pipeline may keep busy (the process's included, the consumer's
            too): the tuner raises no stage while the process uses this many.
        interval: Seconds between the tuner's looks.

    """

    memory_budget: int | None = None
    cpu_budget: float = 0.0  # 0: the cores this process may use
    interval: float = 0.1

    def cores(self) -> float:
        """The CPU budget in cores."""
        return self.cpu_budget if self.cpu_budget > 0 else float(usable_cores())

    @staticmethod
    def check(memory_budget: object, cpu_budget: object) -> None:
        """Refuse budgets that cannot work."""
        if memory_budget is not None and (
            isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
        ):
            raise ConfigurationError(
                f"memory_budget must be a number of bytes (an int) or None, got {memory_budget!r}"
            )
        if isinstance(memory_budget, int) and memory_budget < 1 << 16:
            raise ConfigurationError(
                f"memory_budget={memory_budget} bytes is too small to hold items; it counts "
                "bytes (64 KiB at least): pass e.g. 512 << 20 for 512 MiB"
            )
        if cpu_budget is not None and (
            isinstance(cpu_budget, bool)
            or not isinstance(cpu_budget, int | float)
            or not math.isfinite(cpu_budget)
            or cpu_budget <= 0
        ):
            raise ConfigurationError(
                f"cpu_budget must be a positive number of cores or None, got {cpu_budget!r}"
            )
