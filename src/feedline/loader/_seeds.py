"""Reproducible randomness for datasets whose items are fetched on several threads.

PyTorch's DataLoader calls ``dataset[i]`` one at a time per process, so draws from the global
random generators (``torch``, ``random``, NumPy; torchvision's random transforms use
``torch``'s) happen in a fixed order. feedline calls ``dataset[i]`` on several threads at once:
the order of draws, and so the augmentation, changes from run to run. Two ways out:

* ``fetch_concurrency=1``: one call at a time, the same draws as PyTorch (with its worker
  seeding), at the cost of concurrency;
* a seed per item: while feedline calls ``dataset[i]``, :func:`get_item_info` gives the item a
  seed derived from the epoch's base seed (which comes from the loader's ``generator`` or
  ``torch``'s global state, like PyTorch's worker seeds) and the index. It is the same
  whatever the thread, the worker or the concurrency, and the same after resuming.
  :func:`seeded` seeds the global generators from it around the code that draws (one item at
  a time, restoring them after), so transforms that draw from them need no change.
"""

from __future__ import annotations

import random
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ItemInfo", "RngWatch", "get_item_info", "item_seed", "seeded"]

_MASK = (1 << 64) - 1


def item_seed(base_seed: int, index: Any) -> int:
    """A 63-bit seed for ``index`` in the epoch whose base seed is ``base_seed`` (SplitMix64)."""
    key = index if isinstance(index, int) else hash(repr(index))
    z = (base_seed * 0x9E3779B97F4A7C15 + key + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class ItemInfo:
    """The item that ``dataset[index]`` is being called for, from inside that call.

    Attributes:
        index: The index passed to ``__getitem__``.
        seed: Its seed: a function of the epoch's base seed and ``index`` only.

    """

    index: Any
    seed: int

    def numpy_generator(self) -> np.random.Generator:
        """A NumPy generator seeded for this item."""
        return np.random.default_rng(self.seed)

    def torch_generator(self) -> Any:
        """A ``torch.Generator`` seeded for this item."""
        import torch

        return torch.Generator().manual_seed(self.seed)


_UNTRACKED = object()


class Fetching:
    """What one thread fetches now: the epoch's base seed and the item's index.

    A plain object with slots, set once per item: an attribute of a ``threading.local``
    costs several times more, which items of a microsecond felt (15% fewer items/s).
    """

    __slots__ = ("base", "index")

    def __init__(self, base: int | None) -> None:
        self.base = base
        self.index: Any = _UNTRACKED


class _Current(threading.local):
    slot: Fetching | None = None


_current = _Current()


def fetching(base_seed: int | None) -> Fetching:
    """Mark this thread as fetching for an epoch whose base seed is ``base_seed``.

    The caller sets ``.index`` before each item and calls :func:`done_fetching` after.
    """
    slot = Fetching(base_seed)
    _current.slot = slot
    return slot


def done_fetching() -> None:
    """Mark the calling thread as no longer fetching."""
    _current.slot = None


class _Asked:
    """Whether a dataset of this process has asked for its item's info.

    Then every item's index is tracked; until then only the first batch's, to find out.
    """

    value = False


def asked() -> bool:
    """Whether :func:`get_item_info` (or :func:`seeded`) was called inside a fetch."""
    return _Asked.value


def _info() -> ItemInfo | None:
    slot = _current.slot
    if slot is None or slot.base is None:
        return None
    _Asked.value = True
    if slot.index is _UNTRACKED:  # the first request after the first batch: tracked from now
        return None
    return ItemInfo(slot.index, item_seed(slot.base, slot.index))


def get_item_info() -> ItemInfo | None:
    """The item being fetched, inside ``dataset[i]`` called by ``feedline.DataLoader``.

    The analogue of ``torch.utils.data.get_worker_info()`` for per-item randomness: draw
    from ``info.torch_generator()`` or ``info.numpy_generator()``, or wrap code that draws
    from the global generators in :func:`seeded`. ``None`` outside such a call. Indices
    are tracked for the first batch, and from then on if the dataset asked for them there;
    a dataset that first asks later gets ``None`` once, then its items' info.

    Example::

        class Augmented(Dataset):
            def __getitem__(self, i):
                image = decode(self.paths[i])          # concurrent
                info = feedline.loader.get_item_info()
                flip = info.numpy_generator().random() < 0.5 if info else False
                ...

    """
    return _info()


_seeding = threading.RLock()


@contextmanager
def seeded(seed: int | None = None) -> Iterator[None]:
    """Seed ``torch``, ``random`` and NumPy's global generators for one item, then restore them.

    Inside ``dataset[i]``: the seed is the item's (:func:`get_item_info`) unless given. Blocks
    run one at a time across threads (the generators are global), so keep only the drawing
    part inside (the random transform) and decode outside. Outside a fetch without ``seed``,
    it does nothing.

    Example (torchvision)::

        def __getitem__(self, i):
            image = decode_image(read(self.paths[i]))      # concurrent, GIL released
            with feedline.loader.seeded():                 # reproducible, one at a time
                return self.transform(image), self.labels[i]

    """
    if seed is None:
        info = _info()
        if info is None:
            yield
            return
        seed = info.seed
    torch = sys.modules.get("torch")
    with _seeding:
        saved_random = random.getstate()
        saved_numpy = np.random.get_state()
        saved_torch = torch.random.get_rng_state() if torch is not None else None
        random.seed(seed)
        np.random.seed(seed % 2**32)
        if torch is not None:
            torch.random.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(saved_random)
            np.random.set_state(saved_numpy)
            if torch is not None:
                torch.random.set_rng_state(saved_torch)


class RngWatch:
    """Notices draws from the global generators between :meth:`start` and :meth:`check`.

    Only meaningful over a window in which no other thread of the process runs code that
    draws: the training thread waiting for the first batch, or a worker process.
    """

    warned = False  # once per process

    def __init__(self) -> None:
        self._before: tuple[Any, ...] | None = None

    @staticmethod
    def _states() -> tuple[Any, ...]:
        # Not in the middle of a seeded() block, which sets the generators for its item and
        # puts them back after: its draws are reproducible, and leave nothing drawn.
        with _seeding:
            return RngWatch._read_states()

    @staticmethod
    def _read_states() -> tuple[Any, ...]:
        torch = sys.modules.get("torch")
        torch_state = torch.random.get_rng_state() if torch is not None else None
        numpy_state: Any = np.random.get_state()
        return random.getstate(), numpy_state[1].tobytes(), torch_state

    def start(self) -> None:
        """Remember the generators' states."""
        self._before = self._states()

    def drew(self) -> bool:
        """Whether any generator drew since :meth:`start` (which it calls again)."""
        before, self._before = self._before, self._states()
        if before is None:
            return False
        after = self._before
        drew = before[0] != after[0] or before[1] != after[1]
        if before[2] is not None and after[2] is not None:
            drew = drew or not bool((before[2] == after[2]).all())
        return bool(drew)

    def check(self, stacklevel: int = 2) -> None:
        """Warn (once per process) if any generator drew since :meth:`start`."""
        if self._before is None or RngWatch.warned:
            self._before = None
            return
        drew = self.drew()
        self._before = None
        if drew:
            RngWatch.warn(stacklevel + 1)

    @staticmethod
    def warn(stacklevel: int = 2, where: str = "on several threads") -> None:
        """Warn (once per process) that the dataset draws from the global generators."""
        if not RngWatch.warned:
            RngWatch.warned = True
            warnings.warn(
                "the dataset draws from the global random generators (torch, random or NumPy; "
                "torchvision's random transforms do) while feedline.DataLoader fetches items "
                f"{where}, so the draws, and the augmentation, differ from run to "
                "run. For PyTorch's exact draws use fetch_concurrency=1; for a reproducible "
                "seed per item, draw inside `with feedline.loader.seeded():` or from "
                "feedline.loader.get_item_info().torch_generator()",
                RuntimeWarning,
                stacklevel=stacklevel,
            )


def next_only(iterator: Any) -> Iterator[Any]:
    """The items of ``iterator`` (what ``iter()`` of a dataset returned), by ``next()`` only.

    ``itertools.islice`` and ``for`` call ``iter()`` on what they are given; a dataset whose
    ``__iter__`` returns itself and starts its pass over would start over at every batch
    (its first items for ever). PyTorch calls ``iter()`` once per pass, then ``next()``.
    (Not ``iter(callable, sentinel)``: it compares each item with ``==``, which a NumPy
    array refuses and an item with a loose ``__eq__`` answers True, ending the stream.)
    """
    step = iterator.__next__
    while True:
        try:
            item = step()
        except StopIteration:
            return
        yield item
