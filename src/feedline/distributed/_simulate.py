"""The exchanged share of a global batch (beta), simulated without processes.

Beta is what the locality-aware method moves between ranks per step, as a share of the
global batch: the sum of the ranks' deficits (Algorithm 1 moves exactly that). The paper
simulated it for evenly cached datasets; this draws global batches from the run's own
placement (:func:`~._placement.holders`) and, with spare cache for second copies, assigns
the replicated samples exactly (:func:`~._replicas.spread`), so that the spare cache lowers
it.
"""

from __future__ import annotations

import numpy as np

from ._placement import holders, second_copies
from ._replicas import spread

__all__ = ["simulate_beta"]


def simulate_beta(
    world: int,
    local_batch: int,
    *,
    steps: int = 200,
    batches_per_epoch: int = 8,
    spare: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """Beta for ``steps`` random global batches of ``world * local_batch`` samples.

    The dataset has ``batches_per_epoch`` global batches, every sample cached by its holder;
    ``spare`` is the room for second copies, as a share of the dataset (``0.5``: half the
    samples, chosen by hash, have a second holder), and each batch's replicated samples are
    assigned by :func:`~._replicas.spread`. Returns one beta per step.
    """
    if not 0 <= spare <= 1:
        raise ValueError(f"spare is a share of the dataset, in [0, 1]; got {spare!r}")
    batch = world * local_batch
    size = batch * batches_per_epoch
    placed = holders(size, world, seed, 2 if spare > 0 and world > 1 else 1)
    second = second_copies(placed, seed, spare)
    rng = np.random.default_rng(seed)
    out = np.empty(steps)
    for k in range(steps):
        members = rng.choice(size, batch, replace=False)
        trainer = spread(placed[0, members], second[members], world, local_batch)
        counts = np.bincount(trainer, minlength=world)
        out[k] = np.maximum(local_batch - counts, 0).sum() / batch
    return out
