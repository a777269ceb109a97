"""Undoing the random draws an epoch made ahead of the batches it handed out.

The loader draws batches of indices from the sampler before the consumer asks for them
(threads and workers fetch several at once); PyTorch's iterator without workers draws each
batch as it is asked for, and with workers ``prefetch_factor`` per worker ahead. A sampler
that draws from a ``torch.Generator`` the user holds (``generator=``, or the sampler's own)
would, after an epoch left part-way, be further along than under PyTorch, and the next
epoch would shuffle otherwise. :class:`GeneratorRewind` keeps the generators' states after
each batch drawn and, when the epoch is left, puts them back where PyTorch leaves them.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["GeneratorRewind", "sampler_generators"]


def sampler_generators(tl: Any) -> list[Any]:
    """The torch generators a loader's samplers draw from: ``generator=``, the sampler's."""
    found: list[Any] = []
    for owner in (tl, tl.sampler, getattr(tl.batch_sampler, "sampler", None)):
        generator = getattr(owner, "generator", None)
        usable = generator is not None and hasattr(generator, "get_state")
        if usable and all(generator is not g for g in found):
            found.append(generator)
    return found


class GeneratorRewind:
    """The states of ``generators`` after each batch drawn, to put them back later.

    :meth:`drawn` runs in the thread that draws from the sampler, :meth:`handed_out` in the
    consumer's; :meth:`rewind` once drawing has stopped.
    """

    def __init__(self, generators: list[Any]) -> None:
        self._generators = generators
        self._states: dict[int, list[Any]] = {}
        self._last: list[Any] | None = None  # after the latest batch drawn
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._generators)

    def drawn(self, number: int) -> None:
        """Batch ``number`` was drawn (``number - 1`` before the first: the state then)."""
        states = [g.get_state() for g in self._generators]
        with self._lock:
            self._states[number] = self._last = states

    def handed_out(self, number: int) -> None:
        """Batch ``number`` reached the consumer: states before it are not needed any more."""
        with self._lock:
            self._states.pop(number - 1, None)

    def rewind(self, number: int) -> None:
        """Put the generators back to their states after batch ``number`` was drawn.

        Nothing is done where that state was not kept, or where a generator moved since the
        last batch was drawn (the program drew from it meanwhile: its draws stand).
        """
        with self._lock:
            states, last = self._states.get(number), self._last
        if states is None or last is None or states is last:
            return
        if any(not g.get_state().equal(s) for g, s in zip(self._generators, last, strict=True)):
            return
        for generator, state in zip(self._generators, states, strict=True):
            generator.set_state(state)
