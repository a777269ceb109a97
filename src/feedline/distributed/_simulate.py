"""The exchanged share of a global batch (beta), simulated without processes.

Beta is what the locality-aware method moves between ranks per step, as a share of the
global batch: the sum of the ranks' deficits (Algorithm 1 moves exactly that). The paper
simulated it for evenly cached datasets; this draws global batches from the run's own
placement (:func:`~._placement.holders`) and, with replicas, lets each sample count for
whichever of its holders is shortest, so that spare cache lowers it.
"""

from __future__ import annotations

import numpy as np

from ._placement import holders

__all__ = ["simulate_beta"]


def simulate_beta(
    world: int,
    local_batch: int,
    *,
    steps: int = 200,
    batches_per_epoch: int = 8,
    replicas: int = 1,
    seed: int = 0,
) -> np.ndarray:
    """Beta for ``steps`` random global batches of ``world * local_batch`` samples.

    The dataset has ``batches_per_epoch`` global batches, every sample cached by its holder
    (and ``replicas - 1`` more ranks). Returns one beta per step.
    """
    batch = world * local_batch
    size = batch * batches_per_epoch
    placed = holders(size, world, seed, replicas)
    rng = np.random.default_rng(seed)
    out = np.empty(steps)
    for k in range(steps):
        members = rng.choice(size, batch, replace=False)
        if replicas == 1:
            counts = np.bincount(placed[0, members], minlength=world)
        else:
            counts = _assign_replicas(placed[:, members], world, local_batch)
        out[k] = np.maximum(local_batch - counts, 0).sum() / batch
    return out


def _assign_replicas(options: np.ndarray, world: int, local_batch: int) -> np.ndarray:
    """Counts per rank after giving each sample to one of its holders.

    Greedily the one furthest below the local batch size: a stand-in for the exact
    assignment.
    """
    counts = np.bincount(options[0], minlength=world)
    for copy in range(1, options.shape[0]):
        # Move samples from ranks over their share to their other holder where that one
        # is short, as long as it helps.
        for sample in np.argsort(-counts[options[0]], kind="stable"):
            first, other = options[0, sample], options[copy, sample]
            if counts[first] > local_batch and counts[other] < local_batch:
                counts[first] -= 1
                counts[other] += 1
    return counts
