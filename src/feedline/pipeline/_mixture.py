"""Several sources as one: in turn, with weights, or as their items come.

See "Mixtures of sources" in the README. In turn or with weights (smooth weighted round
robin, its starting credits from the seed and epoch) the order is a function of the sources,
the weights, the seed and the epoch alone, so a resumable pipeline resumes a mixture exactly;
``as_ready=True`` takes each source on a thread of its own, in the order items arrive.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from feedline.errors import ConfigurationError

from ._settings import MIXTURE_JOIN_SECONDS

__all__ = ["Mixture"]

T = TypeVar("T")

_STOPS = ("first", "all")
_END = object()  # a source thread's last message


class Mixture(Generic[T]):
    """Items of several sources as one iterable.

    Args:
        sources: The iterables to mix (lists, datasets, pipelines...). Each iteration of the
            mixture calls ``iter()`` on each again, so for several epochs they must be
            iterable again (a generator is not).
        weights: Relative shares of the items (positive numbers); ``None``: one item of each
            source in turn.
        seed: With weights, sets how the sources interleave (with the epoch).
        stop: ``"first"`` (default): the mixture ends when a source runs out; ``"all"``: it
            goes on with the others until every source has run out.
        as_ready: Take each source on a thread of its own and yield items as they come
            (with ``weights=None`` only); not resumed exactly.
        buffer_size: With ``as_ready``, items each source's thread may hold ready.

    Example::

        mix = Mixture([web, books, code], weights=[0.6, 0.3, 0.1], seed=0)
        pipeline = PipelineBuilder().add_source(mix).pipe(decode).add_sink().build()

    """

    def __init__(
        self,
        sources: Sequence[Iterable[T]],
        weights: Sequence[float] | None = None,
        *,
        seed: int = 0,
        stop: str = "first",
        as_ready: bool = False,
        buffer_size: int = 2,
    ) -> None:
        self.sources = list(sources)
        if not self.sources:
            raise ConfigurationError("a Mixture needs at least one source")
        if weights is not None:
            if len(weights) != len(self.sources):
                raise ConfigurationError(
                    f"{len(weights)} weights for {len(self.sources)} sources: give one per source"
                )
            if any(not np.isfinite(w) or w <= 0 for w in weights):
                raise ConfigurationError(f"weights must be positive numbers, got {list(weights)}")
            if as_ready:
                raise ConfigurationError(
                    "as_ready=True yields items as they come, so it cannot keep weights: "
                    "leave out weights, or as_ready"
                )
        if stop not in _STOPS:
            raise ConfigurationError(f"stop must be one of {_STOPS}, got {stop!r}")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ConfigurationError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        self.weights = None if weights is None else [float(w) for w in weights]
        self.seed = seed
        self.stop = stop
        self.as_ready = as_ready
        self.buffer_size = buffer_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Interleave the sources as for ``epoch`` from the next iteration on (with weights).

        Passed on to every source that has a ``set_epoch`` (``TarShards``, a nested
        ``Mixture``, a dataset of the user's), so that each shuffles for the epoch too; a
        pipeline calls it before each of its passes.
        """
        self.epoch = epoch
        for source in self.sources:
            setter = getattr(source, "set_epoch", None)
            if callable(setter):
                setter(epoch)

    def __len__(self) -> int:
        """The items of an iteration, where every source has a length (``TypeError`` else).

        With ``as_ready`` and ``stop="first"``, which items come before the first source runs
        out depends on timing: no length either.
        """
        if self.as_ready and self.stop == "first" and len(self.sources) > 1:
            raise TypeError(
                "a Mixture with as_ready=True and stop='first' has no len(): how many items "
                "come before a source runs out depends on timing"
            )
        sizes = [len(s) for s in self.sources]  # type: ignore[arg-type]
        if self.stop == "all" or len(sizes) == 1:
            return sum(sizes)
        if self.weights is None:  # in turn, until the first one that runs out
            least = min(sizes)
            return least * len(sizes) + sizes.index(least)
        return sum(1 for _ in self._mixed([range(n) for n in sizes]))

    def __iter__(self) -> Iterator[T]:
        if self.as_ready:
            return _as_ready(self.sources, self.stop, self.buffer_size)
        return self._mixed(self.sources)

    def _mixed(self, sources: Sequence[Iterable[Any]]) -> Iterator[Any]:
        iterators = [iter(s) for s in sources]
        pick = _Picker(self.weights, self.seed, self.epoch, len(iterators))
        try:
            while (source := pick.next()) is not None:
                try:
                    item = next(iterators[source])
                except StopIteration:
                    if self.stop == "first":
                        return
                    pick.drop(source)
                    continue
                yield item
        finally:
            # However the mixture ends (a source failed, stop="first", the consumer left),
            # the sources still going are closed now: a pipeline's stops its threads.
            for iterator in iterators:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()


class _Picker:
    """Which source gives the next item: in turn, or by smooth weighted round robin."""

    def __init__(self, weights: list[float] | None, seed: int, epoch: int, count: int) -> None:
        self._turns = weights is None
        self._weights = list(weights) if weights is not None else [1.0] * count
        self._active = [True] * count
        self._left = count
        self._next = 0
        self._total = sum(self._weights)
        # Starting credits from the seed and epoch: within one total, as the credits stay.
        rng = np.random.default_rng([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF])
        credit = rng.random(count) * self._total
        self._credit = (credit - credit.mean()).tolist()

    def next(self) -> int | None:
        """The next source, or ``None`` when none is left."""
        if not self._left:
            return None
        active = self._active
        if self._turns:
            while not active[self._next]:
                self._next = (self._next + 1) % len(active)
            source = self._next
            self._next = (source + 1) % len(active)
            return source
        credit, weights = self._credit, self._weights
        source, best = -1, -float("inf")
        for k, weight in enumerate(weights):  # a handful of sources: plain Python is fastest
            if active[k]:
                credit[k] += weight
                if credit[k] > best:  # ties: the lowest source
                    source, best = k, credit[k]
        credit[source] -= self._total
        return source

    def drop(self, source: int) -> None:
        """``source`` ran out: the others share what is left."""
        self._active[source] = False
        self._left -= 1
        self._total -= self._weights[source]
        self._credit[source] = 0.0


def _as_ready(sources: list[Iterable[Any]], stop: str, buffer_size: int) -> Iterator[Any]:
    # Each source on a thread of its own, into one queue; items in the order they arrive.
    arrived: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue()
    room = [threading.Semaphore(buffer_size) for _ in sources]
    leaving = threading.Event()

    def run(index: int, source: Iterable[Any]) -> None:
        error: BaseException | None = None
        iterator: Any = None
        try:
            iterator = iter(source)
            for item in iterator:
                while not room[index].acquire(timeout=0.1):
                    if leaving.is_set():
                        return
                if leaving.is_set():
                    return
                arrived.put((index, item, None))
        except BaseException as failure:  # the consumer raises it
            error = failure
        finally:
            close = getattr(iterator, "close", None)
            if leaving.is_set() and close is not None:
                close()
        arrived.put((index, _END, error))

    threads = [
        threading.Thread(target=run, args=(k, s), name=f"feedline-mix-{k}", daemon=True)
        for k, s in enumerate(sources)
    ]
    for thread in threads:
        thread.start()
    running = len(threads)
    try:
        while running:
            index, item, error = arrived.get()
            if item is _END:
                if error is not None:
                    raise error
                running -= 1
                if stop == "first":
                    return
                continue
            room[index].release()
            yield item
    finally:
        leaving.set()
        deadline = time.monotonic() + MIXTURE_JOIN_SECONDS
        for thread in threads:  # each leaves at its source's next item (or stays, a daemon)
            thread.join(max(0.0, deadline - time.monotonic()))
