"""The DistributedLoader's epoch ledger: each place of the global sequence handed out once.

A *place* is the ledger's slot: a position in the epoch's global sequence, ``skip`` plus the
index in :meth:`~._sequence.GlobalSequence.order` (rank ``r``'s ``j``-th sample of the
regular split is place ``skip + j * world + r``, so global step ``k`` holds the places from
``skip + k * local_batch * world`` on). A place names one sample of one step, also where the
order pads (the same sample at two places): sample indices would make a padded epoch look
like a repeat. With ``skip`` (an epoch continued with another world size), the places below
it were handed out before the restart, and places are the same under either world size
up to the dataset's size.

Per rank (:class:`EpochLedger`), as the training loop takes each batch:

- ``steps``, a :class:`~feedline._ledger.Ledger` of the steps handed out, checked against the
  loader's position when a state is loaded, when an iteration starts (an iteration that does
  not resume a loaded state is a new pass over its epoch: its ledger starts empty) and at
  the epoch's end;
- ``places``, the places of the samples in the batch (a sample that failed within the
  budget: failed), where the step's plan put them (:attr:`~._plan.RankPlan.positions`). A
  batch that differs from its plan (a planning or exchange bug) is placed where its samples
  stand in the step, and counted: *strays* (in the batch, not given to this rank) and
  *unmet* places (given to it, not in the batch).

At the epoch's end, :func:`settle` adds up the ranks' places over the loader's group, one
``all_reduce`` of a byte per place: every place of the epoch must be handed out (or failed)
by exactly one rank. Two more bytes say how many ranks found their own part wrong and how
many resumed a state saved by another rank (whose places before the resume nobody here
knows: the check then starts where this pass did). Every rank raises the same
:class:`~feedline.LedgerError`; a peer that died makes the collective raise
:class:`~._exchange.ExchangeTimeout` at once, as an exchange does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from feedline._ledger import Ledger, LedgerStats
from feedline.errors import LedgerError

from ._sequence import GlobalSequence

if TYPE_CHECKING:
    from ._exchange import Exchange

__all__ = ["EpochLedger", "Handout", "handout", "resumed", "settle"]


@dataclass(frozen=True)
class Handout:
    """Where the samples of one step's batch stand, found off the training loop's thread.

    Attributes:
        positions: Each sample's position in the step, in batch order (``-1``: nowhere).
        present: Which samples the batch holds (``None``: all; the others failed).
        strays: ``(sample, position)`` of samples the plan did not give this rank.
        unmet: Positions the plan gave this rank that the batch does not hold.

    """

    positions: np.ndarray
    present: np.ndarray | None = None
    strays: list[tuple[int, int]] = field(default_factory=list)
    unmet: list[int] = field(default_factory=list)


def handout(
    members: np.ndarray, planned: np.ndarray, indices: np.ndarray, present: np.ndarray | None
) -> Handout:
    """Place a step's batch: ``indices`` in batch order, in the step's ``members``.

    ``planned`` is where the plan puts them (the rank's ``RankPlan.positions``); a batch as
    planned costs one comparison.
    """
    if planned.size == indices.size and np.array_equal(members[planned], indices):
        return Handout(planned, present)
    # Not the plan's batch: each sample where the plan has it if it can be, else at a place
    # of the step that holds it (the first not taken yet; a place taken twice is a repeat).
    plan = planned.tolist()
    taken: set[int] = set()
    positions, strays = [], []
    for k, index in enumerate(indices.tolist()):
        if k < len(plan) and int(members[plan[k]]) == index and plan[k] not in taken:
            place = plan[k]
        else:
            places = np.flatnonzero(members == index).tolist()
            free = [p for p in places if p not in taken]
            place = (free or places or [-1])[0]
        taken.add(place)
        positions.append(place)
    wanted = set(plan)
    strays = [(i, p) for i, p in zip(indices.tolist(), positions, strict=True) if p not in wanted]
    unmet = sorted(wanted - taken)
    return Handout(np.array(positions, dtype=np.int64), present, strays, unmet)


class EpochLedger:
    """One rank's ledger of one epoch (or of the part of it this pass covers).

    Args:
        epoch: The epoch.
        sequence: Its sequence (the world size, local batch and ``skip`` it was run with).
        rank: This rank.
        known_from: The first step whose places this ledger records (0, unless a state saved
            by another rank was resumed: this rank's places before it are not known).

    """

    def __init__(
        self, epoch: int, sequence: GlobalSequence, rank: int, known_from: int = 0
    ) -> None:
        self.epoch = epoch
        self.sequence = sequence
        self.rank = rank
        self.known_from = known_from
        self.started = known_from  # the first step of the pass under way
        name = f"DistributedLoader epoch {epoch}, rank {rank}"
        self.steps = Ledger(name, unit="step", suspects=_SUSPECTS)
        self.steps.plan(sequence.steps)
        self.places = Ledger(name, unit="place", describe=self.describe, suspects=_SUSPECTS)
        self.strays = 0
        self.first_stray: str | None = None
        self.unmet = 0
        self.first_unmet: str | None = None
        self.ended = False
        self._order: np.ndarray | None = None

    # -- geometry ------------------------------------------------------------------------------

    def base(self, step: int) -> int:
        """The first place of ``step`` (of the steps' end, past the last)."""
        seq = self.sequence
        return seq.skip + min(step * seq.local_batch, seq.per_rank) * seq.world

    @property
    def planned(self) -> int:
        """The places of the epoch: below this, from ``skip`` on."""
        return self.base(self.sequence.steps)

    def describe(self, place: int) -> str:
        """The sample at ``place`` and its step (for messages: draws the epoch's order)."""
        seq = self.sequence
        if not seq.skip <= place < self.planned:
            return "outside the epoch"
        if self._order is None:
            self._order = seq.order(self.epoch)
        step = (place - seq.skip) // (seq.local_batch * seq.world)
        return f"sample {int(self._order[place - seq.skip])}, step {step}"

    # -- recording, on the training loop's thread ----------------------------------------------

    def take(self, step: int, out: Handout) -> None:
        """The loop took ``step``'s batch, whose samples ``out`` places."""
        self.steps.deliver(step)
        base = self.base(step)
        places = out.positions + base
        if out.present is None and not out.strays:  # as planned: every sample has its place
            self.places.deliver_many(places.tolist())
        else:
            present = np.ones(places.size, bool) if out.present is None else out.present
            for place, there in zip(places.tolist(), present.tolist(), strict=True):
                if place >= base:  # else it stands nowhere in the step (a stray)
                    (self.places.deliver if there else self.places.fail)(place)
        if out.strays:
            self.strays += len(out.strays)
            if self.first_stray is None:
                index, position = out.strays[0]
                where = f"place {base + position}" if position >= 0 else "no place"
                self.first_stray = f"sample {index} at {where} of step {step}"
        if out.unmet:
            self.unmet += len(out.unmet)
            if self.first_unmet is None:
                place = base + out.unmet[0]
                self.first_unmet = f"place {place} ({self.describe(place)})"

    # -- checks --------------------------------------------------------------------------------

    def check_position(self, step: int, position: str = "the saved position") -> None:
        """Raise :class:`~feedline.LedgerError` unless resuming at ``step`` is right.

        The steps before it were handed out and none after, this rank's places lie in them,
        as many per step as the step's local batch, and every batch so far was its plan's.
        ``position`` names the position in messages.
        """
        self.steps.check_resume(step, position=position)
        own = self._own_batches()
        if own:
            _fail(self.places.name, "; ".join(own), "its position")
        bits = _bits(self.places, self.planned + 1)
        low, high = self.base(self.known_from), self.base(step)
        later = np.flatnonzero(bits[high:])
        if later.size:
            place = high + int(later[0])
            _fail(
                self.places.name,
                f"{position} resumes at step {step} but {later.size} place(s) after it were "
                f"handed out already (first: place {place} ({self.describe(place)})): the "
                "resumed epoch would repeat them",
                "its position",
            )
        if high <= low:
            return
        starts = [self.base(k) - low for k in range(self.known_from, step)]
        counts = np.add.reduceat(bits[low:high].astype(np.int64), starts)
        seq = self.sequence
        for k, count in zip(range(self.known_from, step), counts.tolist(), strict=True):
            rows = min(seq.local_batch, seq.per_rank - k * seq.local_batch)
            if count != rows:
                _fail(
                    self.places.name,
                    f"step {k} was handed out with {count} of the {rows} samples each rank "
                    "trains on per step (handed out or failed)",
                    "its position",
                )

    def _own_batches(self) -> list[str]:
        parts = []
        if self.strays:
            parts.append(
                f"{self.strays} sample(s) handed out that its plan gave another rank (first: "
                f"{self.first_stray})"
            )
        if self.unmet:
            parts.append(
                f"{self.unmet} place(s) its plan gave it left out of its batches (first: "
                f"{self.first_unmet})"
            )
        return parts

    def findings(self) -> list[str]:
        """At the epoch's end: what is wrong with this rank's own part (none: nothing)."""
        self.ended = True
        return self.steps.end_findings() + self.places.end_findings() + self._own_batches()

    # -- statistics and state ------------------------------------------------------------------

    def stats(self) -> LedgerStats:
        """The rank's counts: ``planned`` is its share of the places the ledger covers."""
        seq = self.sequence
        share = (self.base(seq.steps) - self.base(self.known_from)) // seq.world
        own = self.places.stats()
        missing = None
        if self.ended:
            missing = max(0, share - own.delivered - own.failed)
        return LedgerStats(share, own.delivered, own.failed, own.repeated, missing)

    def state_dict(self) -> dict[str, Any]:
        """The ledger as plain data, with the geometry its places belong to."""
        return {
            "epoch": self.epoch,
            "rank": self.rank,
            "world_size": self.sequence.world,
            "batch_size": self.sequence.local_batch,
            "skip": self.sequence.skip,
            "known_from": self.known_from,
            "steps": self.steps.state_dict(),
            "places": self.places.state_dict(),
            "strays": [self.strays, self.first_stray],
            "unmet": [self.unmet, self.first_unmet],
        }

    @classmethod
    def from_state(cls, state: Any, like: GlobalSequence) -> EpochLedger:
        """A saved ledger (from :meth:`state_dict`), over ``like`` with its geometry."""
        try:
            sequence = GlobalSequence(
                like.size,
                int(state["world_size"]),
                int(state["batch_size"]),
                like.seed,
                like.shuffle,
                like.drop_last,
                skip=int(state["skip"]),
            )
            ledger = cls(
                int(state["epoch"]), sequence, int(state["rank"]), int(state["known_from"])
            )
            ledger.steps.load_state_dict(state["steps"])
            ledger.places.load_state_dict(state["places"])
            ledger.strays, ledger.first_stray = int(state["strays"][0]), state["strays"][1]
            ledger.unmet, ledger.first_unmet = int(state["unmet"][0]), state["unmet"][1]
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise ValueError(
                f"a damaged ledger in the saved state ({error!r}): pass the dict that "
                "state_dict() returned, unchanged"
            ) from error
        return ledger


def resumed(state: dict[str, Any], now: GlobalSequence, rank: int) -> EpochLedger | None:
    """The ledger a loaded ``state`` continues with, after checking its position against it.

    Args:
        state: What ``DistributedLoader.state_dict()`` returned (on any rank).
        now: The sequence the loader continues with (its world size, batch size and skip).
        rank: This rank.

    Returns:
        The saved ledger, where it is this rank's and ``now`` continues the same sequence;
        one that knows the steps but not this rank's places before them where another
        rank saved it, or it has no ledger; ``None`` where ``now`` starts over (another
        world size or batch size: a new sequence from ``skip``).

    Raises:
        LedgerError: The position is not the one the saved ledger reached.

    """
    epoch, step = int(state["epoch"]), int(state["step"])
    saved = state.get("ledger")
    same = state["world_size"] == now.world and state["batch_size"] == now.local_batch
    if saved is not None:
        ledger = EpochLedger.from_state(saved, now)
        seq = ledger.sequence
        geometry = (seq.world, seq.local_batch, seq.skip)
        told = (int(state["world_size"]), int(state["batch_size"]), int(state.get("skip", 0)))
        if ledger.epoch != epoch or geometry != told:
            _fail(
                ledger.places.name,
                f"the saved position is in epoch {epoch} with (world size, batch size, skip) "
                f"{told}, its ledger in epoch {ledger.epoch} with {geometry}",
                "load_state_dict()",
            )
        ledger.check_position(step)
        trained = min(step * seq.local_batch, seq.per_rank) * seq.world
        consumed = min(seq.size, seq.skip + trained)
        if int(state["consumed"]) != consumed:
            _fail(
                ledger.places.name,
                f"the saved position says {state['consumed']} samples of the epoch's order were "
                f"consumed, its ledger's {step} steps hand out {consumed}",
                "load_state_dict()",
            )
        if not same:
            return None
        if ledger.rank == rank:
            return ledger
    elif not same:
        return None
    # Another rank's state (a checkpoint that rank 0 saved for all), or one saved without a
    # ledger: the steps are known, this rank's places before the resume are not.
    partial = EpochLedger(epoch, now, rank, known_from=step)
    if saved is not None:
        partial.steps.load_state_dict(saved["steps"])
    else:
        partial.steps.deliver_range(0, step)
    return partial


def settle(ledger: EpochLedger, exchange: Exchange | None, world: int) -> bool:
    """At the epoch's end, on every rank: check this rank's part, then all ranks' together.

    Returns whether the epoch was checked across the ranks (not where a rank's saved state
    leaves the places before the resume unknown: only the places from there on are).

    Raises:
        LedgerError: On every rank alike, naming the first place wrong and how many; a rank
            whose own part is wrong adds what it found.
        ExchangeTimeout: A rank died, or did not reach the epoch's end within the timeout.

    """
    own = ledger.findings()
    seq = ledger.sequence
    planned = ledger.planned
    dtype = np.uint8 if world < 255 else np.int32  # a place's count is at most the world
    counts = np.zeros(planned - seq.skip + 2, dtype=dtype)
    counts[:-2] = _bits(ledger.places, planned)[seq.skip :]
    counts[-2] = ledger.known_from > 0
    counts[-1] = bool(own)
    where = f"end of epoch {ledger.epoch}"
    if exchange is not None:
        counts = exchange.total(counts, "the epoch's ledger check", where)
    partial, wrong = int(counts[-2]), int(counts[-1])
    start = ledger.base(ledger.started) - seq.skip if partial else 0
    parts = _across(ledger, counts[start:-2], seq.skip + start, world)
    if wrong:
        parts.append(
            f"{wrong} rank(s) found their own part wrong"
            + (f" (rank {ledger.rank}: {'; '.join(own)})" if own else "")
        )
    if parts:
        repeated = int(np.maximum(counts[start:-2].astype(np.int64) - 1, 0).sum())
        name = f"DistributedLoader epoch {ledger.epoch}, across {world} rank(s)"
        _fail(name, "; ".join(parts), "the epoch's end", repeated=repeated)
    return not partial


def _across(ledger: EpochLedger, counts: np.ndarray, first: int, world: int) -> list[str]:
    # The places handed out by more than one rank, and by none.
    wrong = np.flatnonzero(counts != 1)
    if not wrong.size:
        return []
    parts = []
    many = wrong[counts[wrong] > 1]
    if many.size:
        place = first + int(many[0])
        parts.append(
            f"{many.size} place(s) handed out by more than one rank (first: place {place} "
            f"({ledger.describe(place)}), by {int(counts[many[0]])} of {world})"
        )
    none = wrong[counts[wrong] == 0]
    if none.size:
        place = first + int(none[0])
        parts.append(
            f"{none.size} place(s) handed out by no rank, nor failed (first: place {place} "
            f"({ledger.describe(place)}))"
        )
    return parts


def _bits(ledger: Ledger, count: int) -> np.ndarray:
    # Done (delivered or failed) per slot below ``count``, as 0 or 1.
    raw = ledger.done_bits()
    short = (count + 7) // 8 - len(raw)
    if short > 0:  # unpackbits pads an empty array with whatever memory holds
        raw += bytes(short)
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=count, bitorder="little")


_SUSPECTS = "a bug in feedline.distributed (its plan, its exchange or its position)"


def _fail(name: str, text: str, when: str, repeated: int = 0) -> None:
    raise LedgerError(
        f"{name}: {text}. Checked at {when}: the epoch did not hand out each sample of its "
        f"global batches exactly once, by one rank: {_SUSPECTS}; please report it with this "
        "message",
        repeated=repeated,
    )
