"""The plan of one global step: who trains on which samples, and who sends what to whom.

Every rank computes the same plan from the same inputs (the step's samples, as the regular
split gives them, and each sample's holder), so no rank asks another what to do. A rank
trains on the samples of the step it holds, up to its local batch size; ranks holding more
send the rest (Algorithm 1 decides how many to whom), and samples nobody holds are read from
storage by the ranks still short, before any exchange is planned. Each rank ends with exactly
its local batch size, and the union over ranks is exactly the regular global batch.

Where samples have a second holder (spare cache for replicas), :func:`~._replicas.spread`
first picks which holder of each such sample takes it, so that as few as possible travel.
A rank's plan can also list the copies that fill the second holders' caches: each sample
goes from the holder that takes it to its other holder (the loader sends them in its first
epoch, when the samples are read from storage anyway). :func:`with_fills` adds samples no
step trains on (what ``drop_last`` leaves out of that epoch), for the caches only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ._balance import balance
from ._replicas import spread

__all__ = ["RankPlan", "StepPlan", "plan_for", "plan_step", "with_fills"]


@dataclass(frozen=True)
class StepPlan:
    """One step, for every rank.

    Attributes:
        keep: Per rank, the samples it holds and trains on.
        read: Per rank, the samples it reads from storage (held by nobody).
        sends: ``(source, destination, samples)``: what the source sends the destination.
        size: The global batch (all ranks' local batches together).

    """

    keep: list[np.ndarray]
    read: list[np.ndarray]
    sends: list[tuple[int, int, np.ndarray]]
    size: int

    @property
    def exchanged(self) -> int:
        """Samples sent between ranks."""
        return sum(len(s) for _, _, s in self.sends)

    @property
    def beta(self) -> float:
        """The exchanged share of the global batch (the paper's beta for this step)."""
        return self.exchanged / self.size if self.size else 0.0

    def batch(self, rank: int) -> np.ndarray:
        """What ``rank`` trains on: what it keeps, reads and receives (in that order)."""
        received = [s for _, dst, s in self.sends if dst == rank]
        return np.concatenate([self.keep[rank], self.read[rank], *received])


@dataclass(frozen=True)
class RankPlan:
    """One step, for one rank: all a rank needs, computed in about a millisecond at scale.

    Attributes:
        keep: The samples it holds and trains on.
        read: The samples it reads from storage (held by nobody).
        sends: ``(destination, samples)``: what it sends to other ranks.
        receives: ``(source, count)``: how many samples each other rank sends it.
        exchanged: Samples sent between all ranks in the step (beta times the global batch).
        copies: ``(destination, samples)``: samples it takes whose other holder is the
            destination, to keep there (asked for with ``copies=True``; else empty).
        copies_in: ``(source, count)``: how many such copies each other rank sends it.
        fills: Samples no step of the epoch trains on that it reads into its cache (see
            :func:`with_fills`; else empty).
        positions: Where each sample it trains on stands in the step (``row * world +
            column`` of the step's array), in the order of its batch: kept, read, then
            received by source rank (asked for with ``positions=True``; else empty). A
            padded step may hold a sample twice: its place says which of the two this is.

    """

    keep: np.ndarray
    read: np.ndarray
    sends: list[tuple[int, np.ndarray]]
    receives: list[tuple[int, int]]
    exchanged: int = 0
    copies: list[tuple[int, np.ndarray]] = field(default_factory=list)
    copies_in: list[tuple[int, int]] = field(default_factory=list)
    fills: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    positions: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


@dataclass(frozen=True)
class _Shares:
    # What every rank computes alike for a step: holdings, reads, transfers.
    flat: np.ndarray
    owner: np.ndarray  # the holder that takes each sample (-1: held nowhere)
    other: np.ndarray | None  # each sample's other holder (-1: none); None without replicas
    missing: np.ndarray
    read_starts: np.ndarray
    keep_counts: np.ndarray
    transfers: list[tuple[int, int, int]]


def _shares(step: np.ndarray, holder: np.ndarray, second: np.ndarray | None) -> _Shares:
    rows, world = step.shape
    flat = step.ravel()
    owner = np.take(holder, flat)  # faster than holder[flat] for a batch of random indices
    held = owner >= 0
    other = None
    if second is not None:
        other = np.take(second, flat)
        if (other >= 0).any():
            first = owner
            owner = np.full(flat.shape, -1, dtype=np.int64)
            owner[held] = spread(first[held], other[held], world, rows)
            other = np.where(owner == first, other, first)  # the holder that does not take it
    everything = bool(held.all())
    counts = np.bincount(owner if everything else owner[held], minlength=world)
    wanted = np.full(world, rows, dtype=np.int64)
    # Samples held by nobody go to the ranks that fall short, largest shortfall first.
    missing = flat[:0] if everything else flat[~held]
    read_counts = np.zeros(world, dtype=np.int64)
    if missing.size:
        short = np.maximum(wanted - counts, 0)
        left = len(missing)
        for rank in np.argsort(-short, kind="stable").tolist():
            if left == 0 or short[rank] == 0:
                break
            take = min(int(short[rank]), left)
            read_counts[rank] = take
            left -= take
    read_starts = np.concatenate(([0], np.cumsum(read_counts)))
    wanted_held = wanted - read_counts
    return _Shares(
        flat=flat,
        owner=owner,
        other=other,
        missing=missing,
        read_starts=read_starts,
        keep_counts=np.minimum(counts, wanted_held),
        transfers=balance(counts, wanted_held),
    )


def plan_for(
    step: np.ndarray,
    holder: np.ndarray,
    rank: int,
    second: np.ndarray | None = None,
    *,
    copies: bool = False,
    positions: bool = False,
) -> RankPlan:
    """What ``rank`` does in a step (see :func:`plan_step`, which plans every rank alike).

    With ``copies``, the plan also lists the copies that fill the second holders' caches;
    with ``positions``, where each sample the rank trains on stands in the step.
    """
    shares = _shares(step, holder, second)
    held = shares.owner == rank
    mine = shares.flat[held]  # what the rank holds, in step order
    kept = int(shares.keep_counts[rank])
    sends, receives, exchanged = [], [], 0
    cursor = kept
    for src, dst, count in shares.transfers:
        exchanged += count
        if src == rank:
            sends.append((dst, mine[cursor : cursor + count]))
            cursor += count
        elif dst == rank:
            receives.append((src, count))
    start, stop = shares.read_starts[rank], shares.read_starts[rank + 1]
    extra = _copies(shares, rank) if copies else {}
    if positions:
        extra["positions"] = _positions(shares, held, rank, kept, start, stop)
    return RankPlan(
        keep=mine[:kept],
        read=shares.missing[start:stop],
        sends=sends,
        receives=receives,
        exchanged=exchanged,
        **extra,
    )


def _positions(
    shares: _Shares, mine: np.ndarray, rank: int, kept: int, start: int, stop: int
) -> np.ndarray:
    # The places of the rank's batch in the step (``mine``: where it holds): every rank
    # computes each holder's samples in step order, and each sender gives away those after
    # the ones it keeps, in the order of the transfers, so the receiver knows their places.
    owner = shares.owner
    parts = [np.flatnonzero(mine)[:kept]]
    if stop > start:
        parts.append(np.flatnonzero(owner < 0)[start:stop])
    given = shares.keep_counts.tolist()  # per sender, where its next transfer starts
    froms = []
    for src, dst, count in shares.transfers:
        if dst == rank:
            froms.append((src, given[src], count))
        given[src] += count
    for src, first, count in sorted(froms):
        parts.append(np.flatnonzero(owner == src)[first : first + count])
    return np.concatenate(parts).astype(np.int64, copy=False)


def _copies(shares: _Shares, rank: int) -> dict[str, Any]:
    # Every sample the rank takes goes to its other holder, and every sample it is the other
    # holder of comes from the holder that takes it: both sides count the same samples.
    other, owner, world = shares.other, shares.owner, len(shares.keep_counts)
    if other is None:
        return {}
    out = (owner == rank) & (other >= 0)
    samples, destinations = shares.flat[out], other[out]
    order = np.argsort(destinations, kind="stable")
    samples, destinations = samples[order], destinations[order]
    ranks, starts = np.unique(destinations, return_index=True)
    bounds = [*starts.tolist(), len(samples)]
    copies = [
        (int(dst), samples[bounds[k] : bounds[k + 1]]) for k, dst in enumerate(ranks.tolist())
    ]
    incoming = np.bincount(owner[(other == rank) & (owner >= 0)], minlength=world)
    copies_in = [(int(src), int(incoming[src])) for src in np.nonzero(incoming)[0]]
    return {"copies": copies, "copies_in": copies_in}


def plan_step(step: np.ndarray, holder: np.ndarray, second: np.ndarray | None = None) -> StepPlan:
    """Plan one global step for every rank.

    Args:
        step: A ``(rows, world)`` array of sample indices: column ``r`` is rank ``r``'s
            regular local batch.
        holder: Each sample's rank (``-1``: held nowhere).
        second: Each sample's second holder (``-1``: none), where spare cache keeps
            replicas (:func:`~._placement.second_copies`); either holder may take it.

    """
    world = step.shape[1]
    shares = _shares(step, holder, second)
    flat, owner = shares.flat, shares.owner
    order = np.argsort(np.where(owner >= 0, owner, world), kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(owner[owner >= 0], minlength=world))))
    keep = [flat[order[bounds[r] : bounds[r] + shares.keep_counts[r]]] for r in range(world)]
    starts = shares.read_starts
    read = [shares.missing[starts[r] : starts[r + 1]] for r in range(world)]
    sends = []
    cursor = bounds[:-1] + shares.keep_counts  # the next sample each rank gives away
    for src, dst, count in shares.transfers:
        sends.append((src, dst, flat[order[cursor[src] : cursor[src] + count]]))
        cursor[src] += count
    return StepPlan(keep=keep, read=read, sends=sends, size=flat.size)


def with_fills(
    plan: RankPlan,
    samples: np.ndarray,
    holder: np.ndarray,
    rank: int,
    second: np.ndarray | None = None,
) -> RankPlan:
    """``plan`` with ``samples``, which no step trains on, read into their holders' caches.

    Each holder reads its own of them (``fills``) and, with replicas, sends each a copy to
    its second holder in the step's message, as the first epoch does for the samples it
    trains on; every rank computes the same from ``samples`` (the same on every rank).
    """
    owner = np.take(holder, samples)
    fills = samples[owner == rank]
    if second is None:
        return replace(plan, fills=fills)
    other = np.take(second, samples)
    out = (owner == rank) & (other >= 0)
    copies = {dst: [indices] for dst, indices in plan.copies}
    for dst in np.unique(other[out]).tolist():
        copies.setdefault(dst, []).append(samples[out & (other == dst)])
    incoming = collections.Counter(dict(plan.copies_in))
    incoming.update(owner[(other == rank) & (owner >= 0)].tolist())
    return replace(
        plan,
        fills=fills,
        copies=[(dst, np.concatenate(parts)) for dst, parts in sorted(copies.items())],
        copies_in=sorted(incoming.items()),
    )
