"""When a trial that did not pay may be made again: one schedule for the tuner and the loader.

Both the pipeline's tuner (a stage of ``executor="auto"`` tried in worker processes) and
``DataLoader(num_workers="auto")`` (fetching tried in worker processes) judge a move on a
window or two and go back where it did not pay. A window's rate spreads by about the gain a
move must show, so some moves that would pay go back: the next trial comes soon, and later
ones, each of which found no gain again, further apart.
"""

from __future__ import annotations

__all__ = ["RETRY_AFTER", "RETRY_MOST", "retry_delay"]

RETRY_AFTER = 30.0
"""Seconds before another trial, after the first that did not pay; each later one that does
not pay doubles them, up to :data:`RETRY_MOST` (a trial costs two moves and a window, a tenth
of a second or so; a trial that noise sent back costs the gain until the next)."""

RETRY_MOST = 480.0
"""The most seconds between trials."""


def retry_delay(backs: int) -> float:
    """Seconds before the next trial, after ``backs`` earlier trials went back (0: the first)."""
    return min(RETRY_MOST, RETRY_AFTER * float(2 ** min(backs, 16)))
