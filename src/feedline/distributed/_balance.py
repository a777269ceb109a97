"""Algorithm 1 of the locality-aware loading paper: balance the ranks' shares of a batch.

Each rank holds some of a global batch's samples and must train on exactly its local batch
size. Ranks with a surplus send samples to ranks with a deficit; the volume is fixed (the sum
of the deficits), and the algorithm keeps the number of messages low: it repeatedly pairs the
largest surplus with the largest deficit and moves as much as the smaller allows, so each
message settles at least one rank (at most ``p - 1`` messages, a 2-approximation of the
fewest). Ties go to the lower rank, so every rank computes the same plan.
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["balance"]


def balance(held: np.ndarray, wanted: np.ndarray) -> list[tuple[int, int, int]]:
    """The transfers ``(source rank, destination rank, samples)`` that even out a batch.

    Afterwards every rank has ``wanted`` samples where it had ``held``.

    Raises:
        ValueError: If the totals differ (the ranks cannot end with what they want).

    """
    excess = np.asarray(held, dtype=np.int64) - np.asarray(wanted, dtype=np.int64)
    if int(excess.sum()) != 0:
        raise ValueError(
            f"the ranks hold {int(np.sum(held))} samples but want {int(np.sum(wanted))}"
        )
    world = len(excess)
    if world > _RANKS:
        return _balance_tuples(excess)
    # Each heap entry is one int, -(imbalance << 16) + rank: the min-heap pops the largest
    # imbalance first and, among equals, the lowest rank (int comparisons, no tuples).
    ranks = np.nonzero(excess)[0]
    amounts = excess[ranks]
    keys = -(np.abs(amounts) << _SHIFT) + ranks
    positive = amounts > 0
    surplus, deficit = keys[positive].tolist(), keys[~positive].tolist()
    heapq.heapify(surplus)
    heapq.heapify(deficit)
    plan: list[tuple[int, int, int]] = []
    # The loop is the planner's hot spot at scale (about p / 2 transfers a step): locals only.
    append, heappop, heapreplace = plan.append, heapq.heappop, heapq.heapreplace
    shift, mask = _SHIFT, _RANKS - 1
    while surplus:
        s_key, d_key = surplus[0], deficit[0]
        s_neg, d_neg = s_key >> shift, d_key >> shift  # minus the imbalances
        if s_neg < d_neg:  # the surplus is larger: the deficit is settled
            append((s_key & mask, d_key & mask, -d_neg))
            heapreplace(surplus, s_key - (d_neg << shift))
            heappop(deficit)
        else:  # the surplus is settled (and the deficit too, if equal)
            append((s_key & mask, d_key & mask, -s_neg))
            heappop(surplus)
            if s_neg == d_neg:
                heappop(deficit)
            else:
                heapreplace(deficit, d_key - (s_neg << shift))
    return plan


_SHIFT = 16
_RANKS = 1 << _SHIFT  # worlds up to this size use the int-keyed heaps


def _balance_tuples(excess: np.ndarray) -> list[tuple[int, int, int]]:
    # The same algorithm with (imbalance, rank) tuples, for worlds of any size.
    ranks = np.nonzero(excess)[0].tolist()
    amounts = excess[excess != 0].tolist()
    surplus = [(-a, r) for r, a in zip(ranks, amounts, strict=True) if a > 0]
    deficit = [(a, r) for r, a in zip(ranks, amounts, strict=True) if a < 0]
    heapq.heapify(surplus)
    heapq.heapify(deficit)
    plan: list[tuple[int, int, int]] = []
    while surplus:
        s_amount, s_rank = surplus[0]
        d_amount, d_rank = deficit[0]
        moved = min(-s_amount, -d_amount)
        plan.append((s_rank, d_rank, moved))
        if -s_amount == moved:
            heapq.heappop(surplus)
        else:
            heapq.heapreplace(surplus, (s_amount + moved, s_rank))
        if -d_amount == moved:
            heapq.heappop(deficit)
        else:
            heapq.heapreplace(deficit, (d_amount + moved, d_rank))
    return plan
