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
        # The program drew between two batches: the number of the batch before its draws,
        # and the states just after them (before the loader's next draw).
        self._foreign: tuple[int, list[Any]] | None = None
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._generators)

    def before_draw(self, number: int) -> None:
        """Batch ``number`` is about to be drawn: notes whether the program drew since the last."""
        with self._lock:
            last = self._last
        if last is None:
            return
        now = [g.get_state() for g in self._generators]
        if any(not g.equal(s) for g, s in zip(now, last, strict=True)):
            with self._lock:
                self._foreign = (number - 1, now)

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

        The program's own draws stand: nothing is done where a generator moved since the last
        batch was drawn, nor where the program drew between batches drawn after ``number`` and
        the loader drew before them too; where it drew between them and the loader drew
        nothing from ``number`` up to there, the generators go back to just after its draws.
        Nothing is done either where the state after ``number`` was not kept.
        """
        with self._lock:
            states, last, foreign = self._states.get(number), self._last, self._foreign
            then = None if foreign is None else self._states.get(foreign[0])
        if states is None or last is None or states is last:
            return
        if any(not g.get_state().equal(s) for g, s in zip(self._generators, last, strict=True)):
            return
        if foreign is not None and foreign[0] >= number:
            if then is None or any(not a.equal(b) for a, b in zip(states, then, strict=True)):
                return
            states = foreign[1]
        for generator, state in zip(self._generators, states, strict=True):
            generator.set_state(state)
