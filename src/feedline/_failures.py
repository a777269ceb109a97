"""Failure accounting shared by the engine's stages and the loaders.

:class:`FailureBudget` says when skipped items are too many; :class:`LogThrottle` keeps a flood
of failures to a few log lines. Neither knows of pipelines: a stage, the DataLoader and the
distributed loader each count their own failures with them.
"""

from __future__ import annotations

import time

__all__ = ["FailureBudget", "LogThrottle"]


class FailureBudget:
    """How many failed items a stage may skip before the pipeline stops."""

    __slots__ = ("_limit", "description")

    def __init__(self, max_failures: int | float | None) -> None:
        self._limit = max_failures
        if max_failures is None:
            self.description = "no limit"
        elif isinstance(max_failures, float):
            self.description = f"{max_failures:.2%} of items"
        else:
            self.description = f"{max_failures} item(s)"

    def exceeded(self, failures: int, items: int) -> bool:
        """Whether ``failures`` out of ``items`` is over the budget."""
        if self._limit is None:
            return False
        if isinstance(self._limit, float):
            return failures > self._limit * max(items, 100)
        return failures > self._limit


class LogThrottle:
    """The first ``burst`` messages at once, then at most one per ``interval`` s; the rest counted.

    A few failures are each worth a line (which files were bad); a flood is summed up. What
    was held back when the run ends is left for :meth:`take_held` to report in one line.
    Not locked: callers that log from several threads hold their own lock around it.
    """

    __slots__ = ("_burst", "_held", "_interval", "_last", "_last_held", "_sent")

    def __init__(self, interval: float = 1.0, burst: int = 5) -> None:
        self._interval = interval
        self._burst = burst
        self._last: float | None = None
        self._held = 0
        self._sent = 0
        self._last_held = ""

    def admit(self, what: str = "") -> str | None:
        """Whether to log now: ``None`` to stay quiet (the message, ``what``, is counted).

        Otherwise, a suffix to append that says how many were held back since the last one.
        """
        now = time.monotonic()
        early = self._sent < self._burst and not self._held
        if not early and self._last is not None and now - self._last < self._interval:
            self._held += 1
            self._last_held = what
            return None
        held, self._held, self._last = self._held, 0, now
        self._sent += 1
        return f" ({held} more since the last message)" if held else ""

    def take_held(self) -> tuple[int, str]:
        """How many messages were held back since the last one logged, and the last of them.

        Counts them as told.
        """
        held, self._held = self._held, 0
        return held, self._last_held
