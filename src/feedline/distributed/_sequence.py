"""The global mini-batch sequence of an epoch, and its regular split over ranks.

The sequence is a pure function of (seed, epoch, dataset size, world size, local batch size,
drop_last): the order is ``torch.utils.data.DistributedSampler``'s (a ``torch.randperm``
seeded with ``seed + epoch``, padded or cut to a multiple of the world size), rank ``r``
takes every ``world``-th index from position ``r``, and its local batches are consecutive
runs of ``local_batch`` of those, as a ``DataLoader`` over that sampler makes them. Global
step ``k`` is the union over ranks of their ``k``-th local batch; every rank has the same
number of steps, so none waits at a collective for another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from feedline._extras import require_torch

__all__ = ["GlobalSequence"]


@dataclass(frozen=True)
class GlobalSequence:
    """The epochs of a distributed run, step by step, as the regular loader splits them.

    Args:
        size: Samples in the dataset.
        world: Ranks.
        local_batch: Samples per rank and step.
        seed: The shuffle's seed (``DistributedSampler(seed=...)``).
        shuffle: Shuffle each epoch (``False``: the dataset's order).
        drop_last: As ``DistributedSampler(drop_last=...)`` *and* the rank's loader: the
            tail that does not fill a whole world or a whole local batch is left out
            (``False``: the order is padded with its own start to a multiple of the world
            size, and the last local batch may be short).
        skip: Samples at the start of each epoch's order that are left out: those a run
            trained on before it restarted with another world size (the rest of the epoch is
            split over the new ranks as the sampler would split a dataset of what is left).

    """

    size: int
    world: int
    local_batch: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    skip: int = 0

    def __post_init__(self) -> None:
        for name, least in (("size", 0), ("world", 1), ("local_batch", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "an int >= 0" if least == 0 else "a positive int"
                raise ValueError(f"{name} must be {kind}, got {value!r}")
        if not 0 <= self.skip <= self.size:
            raise ValueError(f"skip must be between 0 and size {self.size}, got {self.skip!r}")
        if self.drop_last and 0 < self.size < self.world and self.skip == 0:
            raise ValueError(
                f"drop_last=True leaves nothing of {self.size} samples for {self.world} ranks; "
                "use drop_last=False (the order is padded) or fewer ranks"
            )

    @property
    def per_rank(self) -> int:
        """Samples each rank sees per epoch (``DistributedSampler.num_samples``)."""
        left = self.size - self.skip
        if self.drop_last:
            return left // self.world
        return math.ceil(left / self.world)

    @property
    def steps(self) -> int:
        """Steps per epoch: the same on every rank."""
        if self.drop_last:
            return self.per_rank // self.local_batch
        return math.ceil(self.per_rank / self.local_batch)

    def _drawn(self, epoch: int) -> np.ndarray:
        # The epoch's order of the samples not skipped, before padding or cutting.
        if self.shuffle:
            torch = require_torch("DistributedSampler's shuffled order")
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            drawn = torch.randperm(self.size, generator=generator)
            base: np.ndarray = drawn.numpy().astype(np.int64)
        else:
            base = np.arange(self.size, dtype=np.int64)
        return base[self.skip :]

    def left_out(self, epoch: int) -> np.ndarray:
        """The samples of the epoch's order that none of its steps has (with ``drop_last``).

        The tail that fills no whole world (the sampler's cut) or no whole local batch (the
        loader's); without ``drop_last``, none: the order is padded.
        """
        if not self.drop_last:
            return np.empty(0, dtype=np.int64)
        return self._drawn(epoch)[self.steps * self.local_batch * self.world :]

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's padded (or cut) order of sample indices, as DistributedSampler's."""
        base = self._drawn(epoch)
        total = self.per_rank * self.world
        if total <= base.size:
            return base[:total]
        return np.resize(base, total)  # repeats the order from its start, as the sampler pads

    def grid(self, epoch: int) -> np.ndarray:
        """The epoch as a ``(per_rank, world)`` array.

        Row ``j``, column ``r`` is rank ``r``'s ``j``-th sample.
        """
        return self.order(epoch).reshape(self.per_rank, self.world)

    def step(self, epoch: int, step: int, grid: np.ndarray | None = None) -> np.ndarray:
        """Global step ``step`` as a ``(rows, world)`` array.

        Column ``r`` is rank ``r``'s local batch; ``rows`` is ``local_batch``, or fewer for
        a short last step.
        """
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} of an epoch of {self.steps} steps")
        rows = self.grid(epoch) if grid is None else grid
        return rows[step * self.local_batch : (step + 1) * self.local_batch]
