"""A sync source read only while it says it may be: backpressure from outside the pipeline.

The source stage (``_stages/_threaded.py``) asks :meth:`GatedSource.ready` before each item it
draws, and stops while the answer is no; the source calls the stage's wake-up (given through
:meth:`GatedSource.wake_with`) once it may be read again. A continuous run's passes read only so
far ahead of the consumer's epoch (``_epochs.Passes``); a DataLoader's batches are drawn only as
its fetch threads have room for them (``feedline.loader._ahead``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["GatedSource"]


class GatedSource(abc.ABC):
    """An iterable the source stage reads only while :meth:`ready`.

    Subclass it for a sync source whose reads something outside the pipeline paces (a pause
    the user sets, a budget of items ahead): the source stage ends its job while the answer
    is no, so a stop never waits on it, and resumes when the wake-up is called. Not for
    ``build(continuous=True)``, whose passes are gated by the run. See "Gated sources" in the
    pipeline README.
    """

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Any]:
        """The items."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether the next item may be drawn now (called by the source stage's thread).

        Also before the draw that finds the source's end: the epoch ends only once it is.
        """

    @abc.abstractmethod
    def wake_with(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from any thread) once the source may be read again after a no.

        ``wake`` may call :meth:`ready` before it returns, on the caller's thread: call it
        outside any lock that :meth:`ready` takes.
        """
