"""The DataLoader's epoch ledger: each batch handed out once, checked against its position.

The loader resumes from its :class:`~._state.Position` (batches handed out, a watermark and
the few above it; for an iterable dataset with workers, each worker's batches). The ledger
(:class:`~feedline._ledger.Ledger`) records, as the consumer receives them, the batches
actually handed out, independently of that bookkeeping; at the epoch's end and whenever a
saved state is loaded, the two must agree, and every batch the sampler drew must have been
handed out or reported as failed.

Slots are batch numbers: the epoch's (a sampler's batches, or an iterable dataset's
batches in this process), or each worker's own (an iterable dataset with workers, whose
streams are split between them). A batch that raised in place of its items:

- of a sampler: reported, so failed (a state after it resumes past it, as the loop that
  caught it went on past it);
- of a worker's stream: that worker's stream ended there, and a state after it resumes that
  worker at the batch (nothing in the worker's stream past its last batch handed out is
  owed, or passed over).
"""

from __future__ import annotations

from typing import Any

from feedline._ledger import Ledger, LedgerStats

from ._state import Position

__all__ = ["LoaderLedger", "stream_batch_taken"]


def stream_batch_taken(outcome: str) -> bool:
    """Whether a worker's stream batch with this ``outcome`` counts in its position.

    Not one that raised in place of its items: a state saved after the error resumes that
    worker at the batch, which a job restarted from it must not lose (torchdata's
    ``StatefulDataLoader`` counts only the batches a worker gave).
    """
    return outcome != "raised"


class LoaderLedger:
    """One epoch's ledger of a DataLoader.

    Args:
        workers: An iterable dataset's worker count (a ledger per worker), else ``None``.
        state: The ledger's saved state, when the epoch resumes.

    """

    def __init__(self, workers: int | None, state: Any = None) -> None:
        lanes = 1 if workers is None else workers
        self._streams = workers is not None
        self._lanes = [
            Ledger(
                "DataLoader" if workers is None else f"DataLoader worker {w}'s stream",
                unit="batch",
            )
            for w in range(lanes)
        ]
        if state is not None:
            if not isinstance(state, list) or len(state) != lanes:
                raise ValueError(
                    f"the saved state's ledger has {len(state) if isinstance(state, list) else 0}"
                    f" part(s) where this loader keeps {lanes}: resume with the loader that "
                    "saved it"
                )
            for lane, saved in zip(self._lanes, state, strict=True):
                lane.load_state_dict(saved)

    def deliver(self, number: int, worker: int | None = None) -> None:
        """Batch ``number`` (a worker's own, for streams) was handed out."""
        self._lanes[worker or 0].deliver(number)

    def fail(self, number: int) -> None:
        """The sampler's batch ``number`` failed and was reported (raised, or all skipped)."""
        self._lanes[0].fail(number)

    def plan(self, batches: int) -> None:
        """The sampler drew ``batches`` batches in all this epoch."""
        self._lanes[0].plan(batches)

    def check(self, position: Position, *, end: bool) -> None:
        """Raise :class:`~feedline.LedgerError` unless ``position`` says what was handed out.

        At the epoch's ``end``, also unless every batch the sampler drew was done.
        """
        if self._streams:
            assert position.worker_batches is not None
            for lane, taken in zip(self._lanes, position.worker_batches, strict=True):
                lane.check_resume(taken)
            return
        lane = self._lanes[0]
        lane.check_resume(position.yielded, position.ahead)
        if end:
            lane.check_end()

    def stats(self) -> LedgerStats:
        """The counts, summed over the workers' ledgers."""
        parts = [lane.stats() for lane in self._lanes]
        planned = [p.planned for p in parts]
        missing = [p.missing for p in parts]
        return LedgerStats(
            planned=None if None in planned else sum(p or 0 for p in planned),
            delivered=sum(p.delivered for p in parts),
            failed=sum(p.failed for p in parts),
            repeated=sum(p.repeated for p in parts),
            missing=None if None in missing else sum(m or 0 for m in missing),
        )

    def state_dict(self) -> list[dict[str, Any]]:
        """The ledgers as plain data, one per part."""
        return [lane.state_dict() for lane in self._lanes]
